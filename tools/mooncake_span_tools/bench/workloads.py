"""What ``mooncake-span bench`` runs: model shapes, contenders, workloads, sizes."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

logger = logging.getLogger(__name__)


SCHEMA = "mooncake-span-bench/1"
HOST_PAGE_TOKENS = 64
# The TCP transport queues 1024 transfers per peer plus 1024 admissions; a call
# past 2048 buffers to one peer fails partly (perf-anchors §2c).
TCP_BUFFERS_PER_CALL = 2048
MiB = 1 << 20

SECTIONS = ("grid", "batch", "coalesce", "chunks", "stock")
TOPOLOGIES = ("same", "tcp")


# ---------------------------------------------------------------------------
# what to run


@dataclass(frozen=True)
class ModelShape:
    """Host pool dimensions of one model family; page bytes follow from them."""

    # "dsa" (MLA KV + DSA indexer + Mamba, span shape), "dsa-stock" (the same
    # model as stock sglang 0.5.23 builds it: 256-token pages, KDA state, packed
    # MTP draft layers), "mla" or "mha"
    family: str
    size: str  # label of the KV page size
    layers: int
    kv_lora_rank: int = 0
    rope_dim: int = 0
    heads: int = 0
    head_dim: int = 0
    mamba_layers: int = 2
    page_tokens: int = HOST_PAGE_TOKENS  # host page
    draft_layers: int = 0  # MTP layers packed behind the target layers

    @property
    def is_mla(self) -> bool:
        return self.family != "mha"

    @property
    def has_sidecars(self) -> bool:
        """DSA indexer and Mamba/KDA state next to the KV pool."""
        return self.family in ("dsa", "dsa-stock")

    @property
    def label(self) -> str:
        return f"{self.family}-{self.size}"

    @property
    def kv_page_bytes(self) -> int:
        layers = self.layers + self.draft_layers
        if self.is_mla:
            return layers * self.page_tokens * (self.kv_lora_rank + self.rope_dim) * 2
        return 2 * layers * self.page_tokens * self.heads * self.head_dim * 2


SMALL, LARGE, TINY_LAYERS = "64KiB", "2.5MiB", "78x2KiB"
STOCK = "320KiB"
# Stock sglang 0.5.23 forces a 64 * index_kpool = 256-token page for compressed DSA.
STOCK_PAGE_TOKENS = 256

# bf16 everywhere. Small pages are 1 KiB/token (64 KiB per 64-token page);
# large ones use DeepSeek-V3 MLA dims (512 + 64) over 35 layers and a
# 40-layer MHA with 2 KV heads of 128 per rank (a GQA model at TP4). The
# 78-layer shape is a GLM-5-sized layer_first MLA pool with 2 KiB per-layer
# buffers: K=4 scattered pages make 4 * 78 = 312 buffers per key.
MODELS: dict[tuple[str, str], ModelShape] = {
    ("dsa", SMALL): ModelShape("dsa", SMALL, layers=4, kv_lora_rank=112, rope_dim=16),
    ("dsa", LARGE): ModelShape("dsa", LARGE, layers=35, kv_lora_rank=512, rope_dim=64),
    ("mla", SMALL): ModelShape("mla", SMALL, layers=4, kv_lora_rank=112, rope_dim=16),
    ("mla", LARGE): ModelShape("mla", LARGE, layers=35, kv_lora_rank=512, rope_dim=64),
    ("mha", SMALL): ModelShape("mha", SMALL, layers=4, heads=1, head_dim=64),
    ("mha", LARGE): ModelShape("mha", LARGE, layers=40, heads=2, head_dim=128),
    ("mla", TINY_LAYERS): ModelShape("mla", TINY_LAYERS, layers=78, kv_lora_rank=8, rope_dim=8),
    # dsa-64KiB's per-token dims at the stock 256-token page, plus one packed
    # MTP draft layer: (4 + 1) * 256 * 128 * 2 bytes of KV per key.
    ("dsa-stock", STOCK): ModelShape(
        "dsa-stock",
        STOCK,
        layers=4,
        kv_lora_rank=112,
        rope_dim=16,
        page_tokens=STOCK_PAGE_TOKENS,
        draft_layers=1,
    ),
}
# The compressed DSA model's radix (storage) page is 64 * index_kpool tokens.
DSA_INDEX_KPOOL = 4


@dataclass(frozen=True)
class ContenderSpec:
    """Parsed contender name: ``memcpy``, ``raw-1buf``, ``raw-K4``, ``upstream``,
    ``span-K4``, ``span-K4-mb512`` (span_max_buffers_per_call), ``span-K4-nogroup``
    (span_group_ids=false), and a ``@consec`` suffix for consecutive host pages
    (default: scattered)."""

    name: str
    kind: str
    pages_per_key: int = 1
    max_buffers_per_call: int = TCP_BUFFERS_PER_CALL
    placement: str = "scattered"
    group_ids: bool = True

    @classmethod
    def parse(cls, name: str) -> ContenderSpec:
        base, _, placement_code = name.partition("@")
        placements = {"": "scattered", "consec": "consecutive"}
        if placement_code not in placements:
            raise ValueError(f"unknown placement in contender {name!r}")
        placement = placements[placement_code]
        if base in ("memcpy", "raw-1buf", "upstream"):
            return cls(name, base, 1, placement=placement)
        kind, *tokens = base.split("-")
        if (
            kind not in ("raw", "span")
            or not tokens
            or not tokens[0].startswith("K")
            or not tokens[0][1:].isdigit()
        ):
            raise ValueError(f"unknown contender {name!r}")
        spec = cls(name, kind, int(tokens[0][1:]), placement=placement)
        for token in tokens[1:]:
            if token.startswith("mb") and token[2:].isdigit():
                spec = replace(spec, max_buffers_per_call=int(token[2:]))
            elif token == "nogroup" and kind == "span":
                spec = replace(spec, group_ids=False)
            else:
                raise ValueError(f"unknown option {token!r} in contender {name!r}")
        return spec


@dataclass(frozen=True)
class Workload:
    section: str
    topology: str
    model: ModelShape
    layout: str
    pages_per_run: int
    pages_per_call: int
    contenders: tuple[str, ...]
    # contenders whose failure is the point of the row (past the TCP limit)
    expected_failures: tuple[str, ...] = ()
    # None: the run's defaults
    warmup: int | None = None
    reps: int | None = None
    # run last, on a native client of its own (it may break the client)
    isolated: bool = False

    @property
    def name(self) -> str:
        return (
            f"{self.section}/{self.topology}/{self.model.label}/{self.layout}/"
            f"P{self.pages_per_call}"
        )

    def __post_init__(self) -> None:
        for c in self.contenders:
            spec = ContenderSpec.parse(c)
            if self.pages_per_call % spec.pages_per_key or self.pages_per_run % self.pages_per_call:
                raise ValueError(f"{self.name}: {c} does not divide the pages evenly")


@dataclass(frozen=True)
class BenchConfig:
    quick: bool = False
    reps: int = 4  # timed repetitions, after `warmup` untimed ones
    warmup: int = 1
    topologies: tuple[str, ...] = TOPOLOGIES
    sections: tuple[str, ...] = SECTIONS
    protocol: str = "tcp"
    device: str = ""
    master_server_address: str | None = None
    metadata_server: str | None = None
    segment_bytes: int = 1536 * MiB
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.reps < 1 or self.warmup < 0:
            raise ValueError("reps must be >= 1 and warmup >= 0")
        for t in self.topologies:
            if t not in (*TOPOLOGIES, "remote"):
                raise ValueError(f"unknown topology {t!r}")
        for s in self.sections:
            if s not in SECTIONS:
                raise ValueError(f"unknown section {s!r}; choose from {SECTIONS}")
        if (self.master_server_address is None) != (self.metadata_server is None):
            raise ValueError("an existing cluster needs both --master and --metadata")
        if self.protocol != "tcp" and self.master_server_address is None:
            raise ValueError(
                f"--protocol {self.protocol} needs an existing cluster (--master/--metadata): "
                "the embedded cluster's storage node speaks TCP"
            )


@dataclass(frozen=True)
class _Sizes:
    """Pages per run / per call of each section (full and --quick)."""

    small_run: int
    small_call: int
    large_run: int
    large_call: int
    batch_run: int
    batch_calls: tuple[int, ...]
    coalesce_run: int
    chunk_keys: int
    families: tuple[str, ...]
    spans: tuple[str, ...]
    limit_probe: bool
    stock_run: int  # 256-token host pages (one key each)
    stock_call: int


FULL_SIZES = _Sizes(
    small_run=2048,
    small_call=512,
    large_run=128,
    large_call=64,
    batch_run=4096,
    batch_calls=(64, 256, 1024, 4096),
    coalesce_run=256,
    chunk_keys=1024,
    families=("dsa", "mla", "mha"),
    spans=("span-K1", "span-K2", "span-K4", "span-K8"),
    limit_probe=True,
    stock_run=512,
    stock_call=128,
)
QUICK_SIZES = _Sizes(
    small_run=256,
    small_call=128,
    large_run=16,
    large_call=16,
    batch_run=512,
    batch_calls=(64, 512),
    coalesce_run=64,
    chunk_keys=16,
    families=("dsa", "mla"),
    spans=("span-K1", "span-K4"),
    limit_probe=False,
    stock_run=64,
    stock_call=32,
)


def _stock_workloads(topo: str, z: _Sizes) -> list[Workload]:
    """GLM-5.3-Flash as stock 0.5.23 runs it (one key per 256-token host page)
    beside its span shape (one key per 4 host pages of 64): the same tokens
    and keys per call and per run."""
    local = ("memcpy",) if topo == "same" else ()
    nogroup = ("span-K1-nogroup",) if topo == "same" else ()
    span = MODELS[("dsa", SMALL)]
    return [
        Workload(
            "stock",
            topo,
            MODELS[("dsa-stock", STOCK)],
            "page_first",
            z.stock_run,
            z.stock_call,
            # KV + indexer + state objects per key: group ids cost inside
            # Mooncake, so show K=1 without them too where that cost shows.
            (*local, "raw-1buf", "raw-K1", "span-K1", *nogroup, "upstream"),
        ),
        Workload(
            "stock",
            topo,
            span,
            "page_first",
            DSA_INDEX_KPOOL * z.stock_run,
            DSA_INDEX_KPOOL * z.stock_call,
            (*local, "raw-K4", "span-K4", "upstream"),
        ),
    ]


def plan_workloads(config: BenchConfig) -> list[Workload]:
    """The workloads of a run, grouped by topology, each topology's isolated ones last."""
    z = QUICK_SIZES if config.quick else FULL_SIZES
    topologies = ("remote",) if config.master_server_address else config.topologies
    out: list[Workload] = []
    for topo in topologies:
        local = topo == "same"
        if "grid" in config.sections:
            for family in z.families:
                sizes = ((SMALL, z.small_run, z.small_call),)
                if not config.quick or family == "mla":
                    sizes += ((LARGE, z.large_run, z.large_call),)
                for size, run, call in sizes:
                    # The DSA indexer has no layer_first zero-copy pointers in sglang.
                    layouts = ("page_first",) if family == "dsa" else ("page_first", "layer_first")
                    if config.quick and not local:
                        layouts = ("page_first",)
                    for layout in layouts:
                        page_first = layout == "page_first"
                        spans = ("span-K4",) if family == "dsa" else z.spans
                        # upstream refuses MHA layer_first ("use page_first for MHA").
                        upstream = () if family == "mha" and not page_first else ("upstream",)
                        # Mooncake group ids cost grows faster than linearly
                        # with keys per call: show the span backend without them
                        # where per-object costs matter most.
                        nogroup = ("span-K4-nogroup",) if size == SMALL and local else ()
                        contenders = (
                            *(("memcpy",) if local else ()),
                            *(("raw-1buf",) if page_first else ()),
                            "raw-K4",
                            *spans,
                            *nogroup,
                            *upstream,
                        )
                        out.append(
                            Workload(
                                "grid", topo, MODELS[(family, size)], layout, run, call, contenders
                            )
                        )
        if "batch" in config.sections and (local or not config.quick):
            for call in z.batch_calls:
                out.append(
                    Workload(
                        "batch",
                        topo,
                        MODELS[("mla", SMALL)],
                        "page_first",
                        z.batch_run,
                        call,
                        ("raw-K4", "span-K4", "upstream"),
                    )
                )
        if "coalesce" in config.sections:
            out.append(
                Workload(
                    "coalesce",
                    topo,
                    MODELS[("mla", TINY_LAYERS)],
                    "layer_first",
                    z.coalesce_run,
                    z.coalesce_run,
                    ("raw-K4", "span-K4", "raw-K4@consec", "span-K4@consec", "upstream"),
                )
            )
        if "stock" in config.sections:
            out += _stock_workloads(topo, z)
        if "chunks" in config.sections and not local:
            pages = 4 * z.chunk_keys
            sweep = tuple(f"span-K4-mb{mb}" for mb in (512, 1024, 2048))
            # One call of chunk_keys keys x 312 buffers; no warm-up, the
            # segment is warm by now and each run is long.
            out.append(
                Workload(
                    "chunks",
                    topo,
                    MODELS[("mla", TINY_LAYERS)],
                    "layer_first",
                    pages,
                    pages,
                    sweep,
                    warmup=0,
                    reps=min(config.reps, 3),
                )
            )
            if z.limit_probe and topo == "tcp":
                # Past 2048 buffers per peer the TCP lane rejects transfers, the
                # call stalls for Mooncake's 60 s transfer timeout and the
                # client stays broken afterwards: run it once, last, on a
                # client of its own.
                out.append(
                    Workload(
                        "chunks",
                        topo,
                        MODELS[("mla", TINY_LAYERS)],
                        "layer_first",
                        64,
                        64,
                        ("span-K4-mb4096",),
                        expected_failures=("span-K4-mb4096",),
                        warmup=0,
                        reps=1,
                        isolated=True,
                    )
                )
    return out
