"""Pure span logic: geometry, object keys, pointer plans and hit-prefix math.

No I/O, no sglang or Mooncake import; tests drive it with plain integers and numpy arrays.
"""
