"""Tools for trained models: export to Hugging Face, evaluate, the cloze tasks."""
