"""The build's stages, one module each. Every stage is `run(manifest, target) -> manifest` and declares a `STAGE`
(pipeline.build.cache.StageSpec: name, VERSION, config dataclass, packages, host dependence) that its cache key is
derived from. The order they run in is the table in pipeline/build/table.py."""
