//! Content-addressed layer store. See DESIGN.md, "Data model".
