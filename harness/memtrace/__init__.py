"""Full-size memory traces without a GPU: the real step of the own engine or of engine fsdp
(FSDP2 + DTensor TP/SP + torch.distributed.pipelining) for each pipeline stage, run on fake tensors
(torch FakeTensorMode) over a fake process group, in one CPU process. (DeepSpeed is not traced:
its initialize is not traceable on fake tensors.)

trace.py builds each distinct rank role and runs its step while counting every tensor storage
alive (the peak of live tensors), the memory census of the model states at the optimizer step
and the bytes autograd saves; terms.py adds what such a trace cannot see (the CUDA context and
workspaces, the caching allocator's fragmentation) as named terms, from the planner's constants.
`harness memory SPEC.yaml` prints it beside the planner's prediction.
"""
