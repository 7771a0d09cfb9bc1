"""The Llama-family decoder the engine runs, and its weight loader."""
