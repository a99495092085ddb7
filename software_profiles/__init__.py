"""Bundled software presets (YAML data files, each choice with its source): what the training
software does on the hardware of a cluster profile. Load them with
`autopar.SoftwareSpec.load(NAME)`; `autopar` is the default, what `autopar run` executes."""
