"""The planner: predict memory, out-of-memory and step time of layouts before running them.

Modules, one job each:
  hardware        the hardware profiles (peaks, links, calibrated efficiencies)
  layout          what a layout and a workload are (PlannerLayout, Workload), the study's stage split
  rates           GEMM efficiency by size, the link a group spans, its bandwidth, replica-group geometry
  feedforward     a block's feed-forward, dense or mixture of experts (expert parallelism: expert states,
                  dispatch, the all-to-all): one model memory, features and timing ask
  memory          bytes per GPU: the front door (stage_memory, worst_stage_memory, fits)
  memory_terms    the memory terms every engine shares (GIB, stage_params, in_flight, the overheads, Muon's states)
  memory_paper    the memory of the study's engine (engine paper)
  memory_engines  the memory of the harness's engines, each by its facts (registry.MemoryModel)
  context         context parallelism's own terms (implementations, K/V bytes, the exchange)
  schedules       pipeline schedules: chunks per rank, the bubble, the sends, activations in flight
  fp8             FP8 as the engines run it: the FP8 linears, their casts' bytes, the weight copies
  features        the time features of a layer and a stage (ideal seconds of each kind of work)
  timing          seconds per step: the features at their efficiencies, the schedule, the dp reduction
  candidates      every valid layout
  candidate_table the candidates as columns (integer codes per option, each split's fields once)
  predict         memory and time together: one prediction per layout
  predict_columns a plan's predictions as columns, ranked; a Prediction built for the rows read
  output          what a plan hands a user: distinct rows, a sweep
  calibrate       fit efficiency constants from measurements
  paper           the published sweeps, judged
  published       published GPU runs (baselines/published_runs) as samples: fit and check
  findings        the study's findings as one plan predicts them (harness plan --findings)
The command is harness/commands/plan.py. The chosen layout as another framework's launch configuration
(`plan --export`) and back (`harness import`) is harness/interop/. Nothing here imports torch: a plan
must answer in about a second.
"""

from harness.planner.predict import Prediction, predict  # noqa: F401


def __getattr__(name: str):
    """calibrate_from_records, imported when first used: calibration needs numpy, a plan does not."""
    if name == "calibrate_from_records":
        from harness.planner.calibrate import calibrate_from_records

        return calibrate_from_records
    raise AttributeError(f"module 'harness.planner' has no attribute {name!r}")
