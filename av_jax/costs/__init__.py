"""Deployment step-cost models: verify and draft cost from a roofline, or a measured table.

AV's budget trades expected accepted tokens against the step-cost curve of the
deployment (spec section 4; `av_jax.selection.choose_budget`). On a GPU or TPU a
verification pass over T packed tokens reads the weights once and does 2 x params FLOPs
per token, so its cost is flat (memory-bound) until T reaches the roofline's knee

    T* = (peak FLOP/s / memory bandwidth) x bytes_per_param / 2,

about 295 tokens on an H100 SXM and 206 on an H200 in bf16 (vendor peaks: 989 TFLOP/s
against 3.35 and 4.8 TB/s), and per-token (compute-bound) beyond it. Serving-stack studies
of speculation policies separate the two halves of the problem the same way: acceptance
comes from real models, time from the deployment's cost curve (vLLM's adaptive
speculation profiles verify cost by target tokens and draft cost by requests; SmartSpec,
Liu et al. 2024, "Optimizing Speculative Decoding for Serving Large Language Models Using
Goodput"). This module builds that curve for named devices and model shapes, labelled as
modelled, and loads a measured table (`benchmarks/accelerator.py`) in its place.

The model (`roofline_costs`). A program is a few kernels run in sequence: the dense
layers, attention, the output head, and the sampling of the [T, V] logits. Each kernel's
time is max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth): inside one kernel
arithmetic and memory traffic overlap, which is what makes the roofline flat. Kernels
run one after another, so their times add (the combination rule is "max within a
kernel, sum across kernels"; a single max over the whole step would assume attention's
KV-cache streaming hides under the dense matmuls, which no sequential schedule does, and
a plain sum of compute and memory time would double-count the overlap inside a matmul:
up to 2x at the knee). A fixed launch overhead per program and per layer is added.

The measured `cpu` spec adds two terms that XLA:CPU programs pay and accelerators do not
(both measured by start-up microbenchmarks, `measure_cpu`): a transposing gather runs at
its own elements/s (the `per_token` attention, which gathers each token's slot cache into
a transposed layout), and a program whose temporaries reach glibc's 32 MiB mmap threshold
page-faults them in on every run. `docs/costs.md` has the validation against the engine's
profile.

Units: seconds and bytes inside, milliseconds in the tables (the `CostModel` convention).
Dimension letters as elsewhere: B slots, K draft positions, V vocabulary, T packed
tokens, D model width, R active requests.

Example:
  >>> tables = roofline_costs("llama3-8b", "llama3-8b-eagle3", "h200",
  ...                         drafter_kind="autoregressive", num_slots=64, max_draft=8,
  ...                         context_len=2048)
  >>> tables.cost.verify_ms.shape  # [B (K + 1) + 1]
  (577,)

The package's modules: `devices` (`DeviceSpec`, the named devices, the measured `cpu`
spec), `shapes` (`ModelShape`, the published and shipped shapes), `roofline` (kernels,
`Implementation`, `roofline_costs`) and `tables` (`CostTables`, the measured tables'
file format). Every public name is re-exported here.
"""

from av_jax.costs.devices import CPU_GATHER
from av_jax.costs.devices import CPU_LARGE_BYTES
from av_jax.costs.devices import CPU_MATMUL_N
from av_jax.costs.devices import CPU_MIN_SECONDS
from av_jax.costs.devices import CPU_REPEATS
from av_jax.costs.devices import CPU_SMALL_BYTES
from av_jax.costs.devices import DEVICE_NAMES
from av_jax.costs.devices import DEVICES
from av_jax.costs.devices import DTYPE_BYTES
from av_jax.costs.devices import GLIBC_MMAP_THRESHOLD
from av_jax.costs.devices import CpuMeasurement
from av_jax.costs.devices import DeviceSpec
from av_jax.costs.devices import cpu_spec
from av_jax.costs.devices import cpu_spec_from
from av_jax.costs.devices import get_device
from av_jax.costs.devices import knee_tokens
from av_jax.costs.devices import measure_cpu
from av_jax.costs.shapes import SHAPES
from av_jax.costs.shapes import ModelShape
from av_jax.costs.shapes import get_shape
from av_jax.costs.shapes import shape_from_config
from av_jax.costs.shapes import shape_names
from av_jax.costs.shapes import shipped_shapes
from av_jax.costs.tables import COST_TABLE_FORMAT
from av_jax.costs.tables import COST_TABLE_VERSION
from av_jax.costs.tables import CostTables
from av_jax.costs.tables import cost_tables_from_dict
from av_jax.costs.tables import depth_cost_model
from av_jax.costs.tables import draft_fixed_from_depths
from av_jax.costs.tables import load_cost_table
from av_jax.costs.tables import save_cost_table
from av_jax.costs.roofline import DRAFTER_KINDS
from av_jax.costs.roofline import IMPLEMENTATIONS
from av_jax.costs.roofline import Implementation
from av_jax.costs.roofline import Kernel
from av_jax.costs.roofline import drafter_mode
from av_jax.costs.roofline import forward_kernels
from av_jax.costs.roofline import forward_seconds
from av_jax.costs.roofline import get_implementation
from av_jax.costs.roofline import kernel_seconds
from av_jax.costs.roofline import roofline_cost_model
from av_jax.costs.roofline import roofline_costs

__all__ = (
    "COST_TABLE_FORMAT",
    "COST_TABLE_VERSION",
    "CPU_GATHER",
    "CPU_LARGE_BYTES",
    "CPU_MATMUL_N",
    "CPU_MIN_SECONDS",
    "CPU_REPEATS",
    "CPU_SMALL_BYTES",
    "CostTables",
    "CpuMeasurement",
    "DEVICES",
    "DEVICE_NAMES",
    "DRAFTER_KINDS",
    "DTYPE_BYTES",
    "DeviceSpec",
    "GLIBC_MMAP_THRESHOLD",
    "IMPLEMENTATIONS",
    "Implementation",
    "Kernel",
    "ModelShape",
    "SHAPES",
    "cost_tables_from_dict",
    "cpu_spec",
    "cpu_spec_from",
    "depth_cost_model",
    "draft_fixed_from_depths",
    "drafter_mode",
    "forward_kernels",
    "forward_seconds",
    "get_device",
    "get_implementation",
    "get_shape",
    "kernel_seconds",
    "knee_tokens",
    "load_cost_table",
    "measure_cpu",
    "roofline_cost_model",
    "roofline_costs",
    "save_cost_table",
    "shape_from_config",
    "shape_names",
    "shipped_shapes",
)
