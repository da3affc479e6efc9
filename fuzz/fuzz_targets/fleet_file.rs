//! Fleet files (YAML, TOML, JSON) and `--backend` flags: any text gives a fleet or an error.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use switchyard_gateway::config::parse_fleet_file;
use switchyard_gateway::BackendSpec;

fuzz_target!(|data: &[u8]| {
    let Some((&format, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let path = match format % 3 {
        0 => Path::new("fleet.yaml"),
        1 => Path::new("fleet.toml"),
        _ => Path::new("fleet.json"),
    };
    let _ = parse_fleet_file(path, text);
    let _ = BackendSpec::parse_flag(text);
});
