"""Built-in reward models. `digit`: a digit classifier's p(label) for the embedded tiny-sd3 task."""
