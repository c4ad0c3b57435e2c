"""The data miles reads and makes: the prompt JSONL reader the runtime and the preflight share (prompt_file.py), the
deterministic split of sklearn's digits and the moving-digits videos, and their writers. The built-in data sets they
make (`digits:train`, ...) are named and built by `miles.builtin`."""
