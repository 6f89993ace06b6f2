"""The integration layer: what `DiLoCoTrainer`, its pipelined form and `DiLoCoPlugin` share, and each front-end.

| concern | file |
|---|---|
| the settings as a front-end holds them (`diloco_config()`, the fields every rank must share) | `settings.py` |
| joined processes, the rank grid, DDP over the worker's group only, one-process workers | `accelerate_worker.py` |
| the engine in a loop: start-up line, stepping, utilization, metrics, theta_g into the model | `engine_session.py` |
| each rank's DiLoCo state file, its save and load with the world-size check | `rank_state.py` |
| `DiLoCoPlugin` for a raw Accelerate loop (never imports transformers) | `accelerate_plugin.py` |
| `DiLoCoTrainingArguments` and `DiLoCoTrainer`, one file per concern | `trainer/` |

docs/design.md (`## Integrations`) describes what each front-end changes in the Trainer and in Accelerate.
"""
