"""The pipeline: notebooks, manifest, report, runs and ablations."""
