//! The `switchyard` command.
fn main() {}
