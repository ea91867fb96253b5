//! Shared helpers for end-to-end tests.
