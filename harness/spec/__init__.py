"""What to run: a Workload (the same for every engine) and a Layout (how it is parallelised).

Every check of a run spec lives in this package and raises SpecError naming the field, so that a
user mistake is one line and exit code 2 before anything launches. One job a module:

    schema.py        the Workload, Layout and RunSpec dataclasses, the values their fields take
    build.py         a spec dataclass from a user's mapping: spec_field, in_range, coerce, build_spec
    parse.py         parse_spec: the raw spec with its engine's defaults, built, then checked whole
    checks.py        check_sizes: what can be decided without launching (model, batch, sizes, token file)
    capabilities.py  what the chosen engine runs, as its declared facts say
    inputs.py        the other inputs' checks: numbers, names and paths of sweep and compare specs
    labels.py        the layout's text label, the same in every view of a run
    honours.py       what an engine's facts honour, in the schema's words (honoured, some, EVERY_ENGINE)

Every name is re-exported here; `import harness.spec` stays light (no torch).
"""

from harness.files.yaml_reader import load_yaml, read_yaml, yaml_problem  # the one YAML reader, re-exported
from harness.spec.build import build_spec, coerce, in_range, spec_field
from harness.spec.capabilities import (
    capability_error,
    check_capabilities,
    check_honoured,
    check_model_limits,
    check_precision_policy,
    honoured_error,
    model_limit_error,
)
from harness.spec.checks import (
    MAX_BYTES_PER_DEVICE,
    SEQUENCE_FIELDS,
    check_fits_a_machine,
    check_head_dim,
    check_sizes,
    check_token_file,
    check_tokens,
    check_world_size,
)
from harness.spec.honours import (
    EVERY_ENGINE,
    FP8,
    MOE,
    MUON,
    MXFP8,
    SELECTIVE_OP_COMPILE,
    SELECTIVE_OP_FP8,
    honoured,
    some,
)
from harness.spec.inputs import (
    NAME_CHARS,
    NAME_MAX,
    check_device_count,
    check_file_name,
    check_name,
    check_path,
    check_positive,
    check_positive_int,
)
from harness.spec.labels import engine_variant, layout_label, parallel_label, process_counts
from harness.spec.parse import load_spec, parse_spec, spec_from_dict, with_engine_defaults
from harness.spec.schema import (
    ATTENTION_KERNELS,
    CHECKPOINTING,
    COMPILE,
    CP_IMPLS,
    DATA_KINDS,
    DEVICES,
    FP8_RECIPES,
    GRAD_DTYPES,
    INTERLEAVED_SCHEDULES,
    MAX_DEVICES,
    MAX_SEED,
    MAX_STEPS,
    MODEL_IMPLS,
    PIPELINE_P2P,
    PRECISIONS,
    RMSNORM_KERNELS,
    SCHEDULES,
    TOKEN_DTYPES,
    V_SCHEDULES,
    Data,
    Layout,
    Optimizer,
    RunSpec,
    Workload,
    micro_batch_count,
    micro_batches_per_step,
    model_chunks,
    subset,
    through,
)

__all__ = [
    "ATTENTION_KERNELS",
    "CHECKPOINTING",
    "COMPILE",
    "CP_IMPLS",
    "DATA_KINDS",
    "DEVICES",
    "EVERY_ENGINE",
    "FP8",
    "FP8_RECIPES",
    "MXFP8",
    "GRAD_DTYPES",
    "INTERLEAVED_SCHEDULES",
    "MAX_BYTES_PER_DEVICE",
    "MAX_DEVICES",
    "MAX_SEED",
    "MAX_STEPS",
    "MODEL_IMPLS",
    "MOE",
    "MUON",
    "SELECTIVE_OP_COMPILE",
    "SELECTIVE_OP_FP8",
    "NAME_CHARS",
    "NAME_MAX",
    "PIPELINE_P2P",
    "PRECISIONS",
    "RMSNORM_KERNELS",
    "SCHEDULES",
    "SEQUENCE_FIELDS",
    "TOKEN_DTYPES",
    "V_SCHEDULES",
    "Data",
    "Layout",
    "Optimizer",
    "RunSpec",
    "Workload",
    "build_spec",
    "capability_error",
    "check_capabilities",
    "check_device_count",
    "check_file_name",
    "check_fits_a_machine",
    "check_head_dim",
    "check_honoured",
    "check_model_limits",
    "check_name",
    "check_path",
    "check_positive",
    "check_positive_int",
    "check_precision_policy",
    "check_sizes",
    "check_token_file",
    "check_tokens",
    "check_world_size",
    "coerce",
    "engine_variant",
    "honoured",
    "honoured_error",
    "in_range",
    "layout_label",
    "load_spec",
    "load_yaml",
    "micro_batch_count",
    "micro_batches_per_step",
    "model_chunks",
    "model_limit_error",
    "parallel_label",
    "parse_spec",
    "process_counts",
    "read_yaml",
    "some",
    "spec_field",
    "spec_from_dict",
    "subset",
    "through",
    "with_engine_defaults",
    "yaml_problem",
]
