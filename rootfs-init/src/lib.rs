//! Guest side of forkd.
