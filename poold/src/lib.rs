//! poold.
