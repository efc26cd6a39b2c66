"""Pure span logic: geometry, object keys, pointer plans and hit-prefix math.

Nothing here performs I/O or imports sglang or Mooncake; tests drive it with
plain integers and numpy arrays.
"""
