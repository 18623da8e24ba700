"""The own 3D-parallel engine: tensor (+sequence), context, pipeline, expert and data parallelism with ZeRO-1.

Modules, one job each:
  facts         what it runs (harness.registry.EngineFacts), declared without importing torch
  adapter       build(): the engine behind the frameworks' TrainingEngine interface
  topology      (pp, dp, cp, tp) mesh with tp innermost; process groups per axis (and ep, edp); rank map
  schedules     GPipe / 1F1B / interleaved 1F1B / zero-bubble as pure per-rank instruction lists + a simulator
  zero_bubble   the zero-bubble compute orders (zbv's V, interleaved zero_bubble): backward split into B and W
  split_backward  B (the input gradient only, torch's stage_backward_input) and W (the weight gradients later)
  comm          counted, timed collectives and p2p per axis (tp, sp, pp, dp, ep, all)
  tensor_parallel  Megatron-style region functions, vocab-parallel embedding and cross-entropy
  context_parallel attention over a sequence split on cp ranks: ring, allgather and ulysses
  partition     balanced stage partition and the per-rank parameter list (shapes, sharding)
  model         the sharded LLaMA stage modules, built from the reference weights
  experts       a MoE's feed-forward: this ep rank's experts, dispatch and combine by all-to-all
  pipeline      the executor that runs a rank's instruction list
  data_parallel flat bucketed gradients, overlapped DP reduction, ZeRO-1 optimizer shards, and
                the precision policy (bf16 parameters, fp32 main gradients and masters); experts'
                states over their expert-data-parallel group
  comm_model    closed-form per-step communication counts (tested exactly against comm; dense models)
  muon          Muon over the model states' views: ZeRO-1 shards gathered whole per bucket for Newton-Schulz
  engine        ties them together (the frameworks' TrainingEngine interface)
The equivalence checks against the single-device reference live in harness/testing/.
"""
