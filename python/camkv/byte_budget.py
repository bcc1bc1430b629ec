"""A byte budget (kv_bytes): the budget and bits that fit a memory target per layer.

kv_bytes is the most one layer's camkv cache may hold for one sequence, all its KV heads
together (the whole model's heads when they are sharded over processes, so every rank
chooses the same budget): keys, values (their codes, scales and biases when quantized),
scores and positions of budget + slack rows a head, the most a cache holds between
compressions. Given the layer's head shape, it chooses:

- bits: the config's; when nothing says otherwise (make_prompt_cache(model,
  kv_bytes=...) without bits; --kv-bytes without --kv-bits) 4 bits of group 32
  (KV_BYTES_DEFAULTS): of the quantized rows measured in the default's bytes on two
  models, the ones that beat the default on stream KL and passkeys at 10% and 20%
  budgets (bench/results/README.md, "Quantized rows in the default cache's bytes");
- group_size: the config's (or that default's) when it divides both head dimensions,
  else the largest of 128, 64, 32 that does (bits None when none does: MLX cannot
  quantize such heads);
- budget: the largest whose budget + slack rows fit (slack, and the recent window, as
  their defaults make them for that budget unless the config sets them), in what a
  tier the config sets (tier_budget rows a head at tier_bits) leaves; kv_bytes chooses
  no tier itself.

docs/kv-bytes.md lists what it chooses for the measured models' head shapes
(measured_table() makes that table).
"""

from __future__ import annotations

import re

import mlx.core as mx

from .config import GROUP_SIZES, CaMConfig, default_slack
from .quantized import row_bytes

# What kv_bytes chooses besides the budget when the caller gives no bits (module docstring).
KV_BYTES_DEFAULTS = {"bits": 4, "group_size": 32}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_FORM = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(value) -> int:
    """Bytes from an int (>= 1) or a string: a number and a unit, "64MiB", "1.5GiB",
    "500KB", "65536" (units B, KB, MB, GB of 1000 and KiB, MiB, GiB of 1024)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"kv_bytes must be a byte count (an int, or a string like '64MiB'), got {value!r}")
    if isinstance(value, int):
        count = value
    else:
        match = _FORM.fullmatch(value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"kv_bytes must be a number of bytes with an optional unit (B, KB, MB, GB, "
                             f"KiB, MiB, GiB), like '64MiB', got {value!r}")
        count = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if count < 1:
        raise ValueError(f"kv_bytes must be at least 1 byte, got {value!r}")
    return count


def defaults_for(given) -> dict:
    """The KV_BYTES_DEFAULTS fields kv_bytes sets, given the names of the fields the
    caller set: none when it set bits (its rows, its choice), else bits and, unless it set
    group_size, the group."""
    if "bits" in given:
        return {}
    return {name: value for name, value in KV_BYTES_DEFAULTS.items() if name not in given}


def fields_for(config: CaMConfig | None, fields: dict, kv_bytes) -> dict:
    """The CaMConfig fields a cache list gets with kv_bytes (fields as given without it):
    kv_bytes checked, budget refused (kv_bytes chooses it), and defaults_for's fields
    unless a config is given (its fields are then the caller's choice)."""
    if kv_bytes is None:
        return fields
    parse_bytes(kv_bytes)
    if "budget" in fields:
        raise ValueError(f"kv_bytes={kv_bytes!r} chooses the budget; give kv_bytes or budget="
                         f"{fields['budget']!r}, not both")
    return fields if config is not None else {**fields, **defaults_for(fields)}


def layer_shape(model, i: int, shards) -> tuple[int, int, int, int]:
    """(KV heads of the whole model, key dim, value dim, dtype size) of layer i: read from
    its attention's key and value projections (their rows are heads x head dim, quantized
    weights included) and their dtype (a quantized projection's scales')."""
    from .distributed import _attention, local_kv_heads

    heads = local_kv_heads(model, i)
    attention = _attention(model.layers[i])
    dims = []
    for name in ("k_proj", "v_proj"):
        projection = getattr(attention, name, None)
        weight = getattr(projection, "weight", None)
        if weight is None:
            raise ValueError(f"kv_bytes needs layer {i}'s head shape, but its attention "
                             f"({type(attention).__name__}) has no {name}; give budget= instead")
        dims.append(weight.shape[0] // heads)
    dtype = weight.dtype if mx.issubdtype(weight.dtype, mx.floating) else projection.scales.dtype
    total_heads = shards.head_placement(heads)[1] if shards.tensor_size > 1 else heads
    return total_heads, dims[0], dims[1], dtype.size


def for_layer(model, i: int, base: CaMConfig, kv_bytes, shards) -> CaMConfig:
    """base with the budget kv_bytes gives layer i of model (choose, for its head shape)."""
    return choose(kv_bytes, base, *layer_shape(model, i, shards))


def group_for(cfg: CaMConfig, k_dim: int, v_dim: int) -> int | None:
    """The config's group_size when it divides both head dimensions, else the largest
    allowed one that does; None when none does."""
    fits = [g for g in (cfg.group_size, *sorted(GROUP_SIZES, reverse=True)) if k_dim % g == 0 and v_dim % g == 0]
    return fits[0] if fits else None


def choose(kv_bytes, base: CaMConfig, heads: int, k_dim: int, v_dim: int, dtype_size: int) -> CaMConfig:
    """base with the budget (and group_size) that fits kv_bytes for one layer of `heads`
    KV heads of these dimensions and dtype size (the module docstring says how).
    ValueError when not even the smallest budget the config allows fits."""
    total = parse_bytes(kv_bytes)
    bits, group = base.bits, base.group_size
    if bits is not None:
        group = group_for(base, k_dim, v_dim)
        bits = None if group is None else bits
        group = base.group_size if group is None else group
    per_row = heads * row_bytes(k_dim, v_dim, dtype_size, bits, group)
    # A tier the config asks for takes its bytes first (its rows at tier_bits).
    tier = base.tier_budget * heads * row_bytes(k_dim, v_dim, dtype_size, base.tier_bits, group)
    rows = max(0, total - tier) // per_row  # budget + slack must not pass this
    budget = _largest_budget(base, rows)
    shape = (f"{heads} KV heads of {k_dim}+{v_dim} channels at {dtype_size} bytes"
             f"{'' if bits is None else f', {bits}-bit'}: {per_row} bytes a token")
    if budget is None:
        raise ValueError(f"kv_bytes={kv_bytes!r} ({total} bytes{f', {tier} of them the tier' if tier else ''}) "
                         f"holds {rows} rows of {shape}; the config needs at least {base.n_sink + 2} "
                         f"(n_sink + 2) plus its slack")
    try:
        return base.replace(budget=budget, bits=bits, group_size=group)
    except ValueError as err:
        raise ValueError(f"kv_bytes={kv_bytes!r} gives budget {budget} ({shape}), which the config refuses: "
                         f"{err}") from None


def _largest_budget(base: CaMConfig, rows: int) -> int | None:
    """The largest budget whose budget + slack rows fit in `rows` (slack as
    base.replace(budget=...) makes it: its default follows the budget), or None when no
    budget above n_sink + 1 does. budget + slack grows with the budget: a bisection."""
    follows = base.slack == default_slack(base.budget, base.prefill)
    held = lambda b: b + (default_slack(b, base.prefill) if follows else base.slack)
    low, high = base.n_sink + 2, rows
    if held(low) > rows:
        return None
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if held(middle) <= rows else (low, middle - 1)
    return low


# The columns of table(): (heading, the fields given besides kv_bytes).
TABLE_COLUMNS = (("budget, 4-bit group 32 (no bits given)", {}), ("budget, bits=4", {"bits": 4}),
                 ("budget, bits=8", {"bits": 8}), ("budget, bits=None", {"bits": None}))


def table(shapes: dict, targets: list[str], columns=TABLE_COLUMNS) -> str:
    """A markdown table of the budgets choose() gives each head shape (name -> (heads,
    k_dim, v_dim, dtype_size)) at each target, for each column's fields (fields_for's
    defaults applied, as make_prompt_cache applies them)."""
    header = "| model (KV heads x head dim) | kv_bytes | " + " | ".join(title for title, _ in columns) + " |"
    lines = [header, "|" + " --- |" * (2 + len(columns))]
    for name, (heads, k_dim, v_dim, size) in shapes.items():
        for target in targets:
            cells = []
            for _, given in columns:
                base = CaMConfig(**fields_for(None, given, target))
                try:
                    cells.append(str(choose(target, base, heads, k_dim, v_dim, size).budget))
                except ValueError:
                    cells.append("too small")
            lines.append(f"| {name} ({heads} x {k_dim}) | {target} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# The head shapes of the models camkv measures, in bfloat16 (2 bytes).
MEASURED_SHAPES = {
    "SmolLM2-135M": (3, 64, 64, 2),
    "Gemma 3 270M": (1, 256, 256, 2),
    "random-1b, Llama-3-8B": (8, 128, 128, 2),
}
TABLE_TARGETS = ["64KiB", "256KiB", "1MiB", "4MiB", "16MiB"]


def measured_table() -> str:
    """The table of docs/kv-bytes.md: the measured models' head shapes at TABLE_TARGETS."""
    return table(MEASURED_SHAPES, TABLE_TARGETS)
