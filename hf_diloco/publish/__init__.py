"""What a run publishes: the model card and the push to the Hugging Face Hub."""
