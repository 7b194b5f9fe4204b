#!/usr/bin/env python3
"""Cargo's runner for wasm32-wasip1 test binaries: runs one under wasmtime (PyPI), with WASI.

`cargo test --target wasm32-wasip1` calls `python tests/wasi_runner.py <binary.wasm> [args]`
(see .cargo/config.toml). The core's unit tests run there too because `usize` is 32 bits on the
plugin's target. The test binary sees the repository as its current directory (read-only).
"""

import os
import sys

from wasmtime import Engine, ExitTrap, Linker, Module, Store, WasiConfig


def main():
    wasm, args = sys.argv[1], sys.argv[2:]
    engine = Engine()
    linker = Linker(engine)
    linker.define_wasi()
    wasi = WasiConfig()
    wasi.argv = [wasm] + args
    wasi.inherit_stdout()
    wasi.inherit_stderr()
    wasi.inherit_env()
    wasi.preopen_dir(os.getcwd(), ".")
    store = Store(engine)
    store.set_wasi(wasi)
    instance = linker.instantiate(store, Module.from_file(engine, wasm))
    try:
        instance.exports(store)["_start"](store)
    except ExitTrap as exit_:
        return exit_.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
