"""Other frameworks' launch configurations, in and out: the planner's chosen layout written as a
DeepSpeed ds_config, Megatron-LM arguments or a torchtitan recipe (`harness plan --export`), and a
user's own read back as a harness run spec (`harness import`). Reading and writing them is not
planning: this package uses the planner's layout, the planner never uses it.

Modules, one job each:
  exports         the front door of `plan --export`: exportable(), EXPORTERS, the named versions
  deepspeed_out   a ds_config for a named DeepSpeed release
  megatron_out    Megatron-LM's pretrain_gpt.py arguments at a named commit
  torchtitan_out  a torchtitan recipe (Trainer.Config) for a named release
  optimizer       the workload's AdamW and clipping every export writes
  exact           the plan's own kernels beside a tool's many-to-one setting, written and read back
  imports         the front door of `harness import`: each reading checked as a spec (the tool's engine
                  kept where only this machine cannot train it, the planner's check instead)
  megatron_in     Megatron-LM's arguments (a launch script or argument file) read back
  shell           a launch script's command line, its variables resolved as bash would, never run
  shell_words     a script's words, quotes and expansions (${NAME:-default}, arrays, $((...)))
  model_match     a model's dimensions matched to the harness's preset of that shape
  deepspeed_in    a ds_config read back (DeepSpeed's batch rules; "auto" and missing fields)
  torchtitan_in   a torchtitan recipe read back: flavors, degrees, batch, FP8
  torchtitan_recipe  a recipe's settings read as text (ast), never run: one config_registry function,
                  its base recipe first
Nothing here imports torch.
"""
