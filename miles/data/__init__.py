"""The data miles reads and makes: the prompt reader the runtime and the preflight share (prompts.py over the formats
of formats.py, the line reader of prompt_file.py, the condition media of media.py), the deterministic split of
sklearn's digits and the moving-digits videos, and their writers. The built-in data sets they make (`digits:train`,
...) are named and built by `miles.builtin`."""
