//! RocksDB, compiled as a few unity translation units (docs/design.md,
//! "Building RocksDB").
//!
//! librocksdb-sys compiles RocksDB's 343 source files one by one: each
//! parses the same large RocksDB and standard-library headers, so that was
//! most of a fresh release build, and most of a fresh setup on a
//! 2-core host (numbers: docs/BENCHMARKS.md, "Setup on a fresh host").
//! RocksDB supports a unity build (its Makefile's `unity.cc`
//! includes every library source into one file); this crate's build script
//! compiles the same sources with the same defines as eight contiguous
//! unity files, in parallel, into `librocksdb.a` (with clang++ at -O2,
//! the level of RocksDB's own Makefile, when there is a clang++ and `CXX`
//! names no other compiler), in a fraction of the CPU time.
//!
//! How it plugs in, without patching librocksdb-sys: the workspace's
//! `.cargo/config.toml` sets `ROCKSDB_LIB_DIR` (librocksdb-sys then skips
//! its own compile and links `-lrocksdb`, still generating its bindings)
//! and `FORKD_ROCKSDB_UNITY=1` (this script then builds the library and
//! adds its directory to the link search path). `ROCKSDB_COMPILE=1` in the
//! environment goes back to librocksdb-sys's own build (this crate then
//! does nothing); so does pointing `ROCKSDB_LIB_DIR` at a RocksDB of the
//! exact bundled version with `FORKD_ROCKSDB_UNITY=0`.
//!
//! A built library is kept in `<target dir>/forkd-rocksdb-unity/<key>/`,
//! the key hashing the unity files, every source they include, the
//! compiler, its version and its flags: a checkout at a new path (CI
//! clones afresh each run) reuses it, and any change of input misses.
//!
//! Invariants:
//! - The sources, their order and the defines are librocksdb-sys's for the
//!   target (read from its directory, not copied); only the grouping into
//!   translation units differs.
//! - No debug info for RocksDB (a unity file's is huge and its compile
//!   slower); forkd's own crates keep theirs.
//! - `forkd-layers` depends on this crate, so every binary that links
//!   RocksDB links this library.
