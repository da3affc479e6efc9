//! The modules of each crate form layers: no module imports one that (directly or not)
//! imports it back. Read from the sources (`crate::name` paths outside test code).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Top-level module -> the top-level modules its non-test code names as `crate::...`.
fn imports(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("readable source tree") {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().and_then(|e| e.to_str()) != Some("rs") {
                continue;
            }
            let rel = path.strip_prefix(src).expect("under src");
            let module = rel
                .components()
                .next()
                .and_then(|c| c.as_os_str().to_str())
                .unwrap_or_default()
                .trim_end_matches(".rs")
                .to_string();
            if module == "lib" || module == "main" {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("readable file");
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            let deps = edges.entry(module.clone()).or_default();
            let mut rest = code;
            while let Some(at) = rest.find("crate::") {
                rest = &rest[at + "crate::".len()..];
                if rest.starts_with('{') {
                    let group = &rest[1..rest.find('}').unwrap_or(1)];
                    for item in group.split(',') {
                        let name: String = item
                            .trim()
                            .chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect();
                        deps.insert(name);
                    }
                } else {
                    let name: String = rest
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    deps.insert(name);
                }
            }
            deps.remove(&module);
        }
    }
    let modules: BTreeSet<String> = edges.keys().cloned().collect();
    for deps in edges.values_mut() {
        deps.retain(|d| modules.contains(d));
    }
    edges
}

/// A module that reaches itself through its imports, with the path, if any.
fn a_cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    for start in edges.keys() {
        let mut seen = BTreeSet::new();
        let mut stack = vec![(start.clone(), vec![start.clone()])];
        while let Some((at, path)) = stack.pop() {
            for next in &edges[&at] {
                if next == start {
                    let mut cycle = path.clone();
                    cycle.push(next.clone());
                    return Some(cycle);
                }
                if seen.insert(next.clone()) {
                    let mut longer = path.clone();
                    longer.push(next.clone());
                    stack.push((next.clone(), longer));
                }
            }
        }
    }
    None
}

#[test]
fn no_crate_has_an_import_cycle() {
    let crates = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let mut checked = 0;
    for entry in std::fs::read_dir(crates).expect("the crates") {
        let src = entry.expect("an entry").path().join("src");
        if !src.is_dir() {
            continue;
        }
        let edges = imports(&src);
        checked += 1;
        if let Some(cycle) = a_cycle(&edges) {
            panic!("{}: import cycle {}", src.display(), cycle.join(" -> "));
        }
    }
    assert!(checked >= 8, "only {checked} crates found");
}

#[test]
fn the_cycle_finder_finds_cycles() {
    let edges: BTreeMap<String, BTreeSet<String>> = [
        ("a".to_string(), ["b".to_string()].into()),
        ("b".to_string(), ["c".to_string()].into()),
        ("c".to_string(), ["a".to_string()].into()),
    ]
    .into();
    assert_eq!(a_cycle(&edges).unwrap(), ["a", "b", "c", "a"]);
}
