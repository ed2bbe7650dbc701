"""Model implementations (the Llama family) and the weight loader."""
