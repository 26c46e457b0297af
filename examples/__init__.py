"""The examples, importable from the repository root: ``from examples.train_char_gpt import CharGPT, load_data``
gives the benchmarks and tests the main job's model and data (each example also runs as a script)."""
