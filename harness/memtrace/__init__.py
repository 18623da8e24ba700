"""Full-size memory traces without a GPU: the real step of the own engine or of engine fsdp
(FSDP2 + DTensor TP/SP + torch.distributed.pipelining) for each pipeline stage, run on fake tensors
(torch FakeTensorMode) over a fake process group, in one CPU process. Which engines are traced is
their facts' word (harness.registry, EngineFacts.tracer); DeepSpeed is not: its initialize is not
traceable on fake tensors. `harness memory SPEC.yaml` prints the result beside the planner's
prediction.

  trace.py     the common driver: which tracer an engine's facts name, trace_rank through it, the
               substitutions the result names, check_traceable, the ranks that stand for each stage
  own.py       the own engine's tracer (Engine3D built under fake mode)
  fsdp.py      engine fsdp's tracer (FSDPEngine; parameters allocated under fake mode)
  step.py      one traced step of one rank: the spec it runs (fewer micro-batches), the census and
               saved-bytes counters, the phases the engine announces, RankTrace
  live.py      the allocation counter: bytes of live tensor storages and their peak, and their order
  allocator.py that order replayed through the CUDA caching allocator's rules: the reserved bytes
  standins.py  what the target GPU runs and a CPU cannot, replaced by kernels, optimizer and
               transfers with the same memory; the BuildOptions a traced engine is built with
  world.py     the fake process group a traced rank runs in
  terms.py     what such a trace cannot see (the CUDA context and workspaces, the caching
               allocator's fragmentation) as named terms, from the planner's constants
  result.py    every stage traced and put beside the planner: the JSON object and its table
"""
