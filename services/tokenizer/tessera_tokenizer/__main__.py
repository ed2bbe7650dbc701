"""`python -m tessera_tokenizer`: run the tokenizer service."""
from tessera_tokenizer.server import main

if __name__ == "__main__":
    raise SystemExit(main())
