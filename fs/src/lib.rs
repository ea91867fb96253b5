//! forkd-fs: the FUSE view of the layer store.
