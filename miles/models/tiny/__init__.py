"""What a running job reads of an offline tiny build: its metadata files (`metadata`, torch-free: the design stamp,
the text encoders' sequence length) and the offline tokenizers' alphabets and merges (`tokenizers`), which the
qwen_image and cosmos3 tokenizers share. The builds themselves live in `miles.builtin.tiny`.
"""
