"""The embedded default: the tiny models, the digits data sets and the digits SFT start points that a job names by
a built-in name (`tiny-sd3`, `digits:labels`, `tiny-sd3-digits-sft-short`), and their builds.

    names        the catalogue (torch-free, imports only `miles.utils.paths`): every built-in name and where it
                 lives under `$MILES_HOME`; the config derives a job's `inputs` from it
    checkpoints  `ensure_checkpoint`: build a built-in model on first use, under a lock, atomically
    teachers     the digits SFT start points: their recipes, stamps and their build (the Trainer of `train sft`)
    datasets     `resolve_dataset`: write a built-in data set on first use
    inputs       `prepare_inputs(args)`: build what a job's `inputs` name, once, in the driver
    tiny         the offline tiny builds: the shared build frame and one module per family

A job's built-in names are resolved to paths once, by the config (`args.inputs`, shown by `inspect-config`);
everything below this package reads plain paths through `miles.core.inputs.input_path`.
"""
