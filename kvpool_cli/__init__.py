"""kvpool_cli: the `kvpool` command line (`main`: the parser and the dispatch; `serve`:
`kvpool serve` and `kvpool generate`).

Where it sits: the top layer. It may import every other package (kvpool_bench,
kvpool_harness, connector, engine, kvpool, metaserver); none of them imports it. Only this
layer reads the environment for its own settings and configures logging.
"""
