"""The offline compiler: checkpoint in, validated artifact out. Imports the runtime, never ops, serving or the CLI.

table.py     the stage table and build(): checkpoint -> export -> optimize -> search | quantize ... -> publish
stages/      exactly the table's rows, each a cached `run(manifest, target) -> manifest`; no stage imports another
search/      the machinery of the search and quantize stages (candidates, decoders, development, int8, fallback)
recipes/     the search's candidate kinds, one registry      passes/   graph -> graph rewrites
inputs/      what a build reads: checkpoints' families (architectures/), tasks, targets, data, the checks
             that a checkpoint folder is closed and its config fits its weights
accuracy/    PyTorch references, metrics and the gate
cache.py, store.py, manifest.py     the stage cache, the artifact store's layout and locks, the build manifest
"""
