"""The main job: its YAML config file, its data and the model it builds (`hf-diloco pretrain`)."""
