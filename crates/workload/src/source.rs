//! Opens line-oriented input files, plain or xz-compressed.

use std::fs::File;
use std::io::{BufRead, BufReader, Cursor, Read};
use std::path::Path;

use crate::error::{Result, WorkloadError};

/// Opens `path` for reading lines; a name ending in `.xz` is decompressed.
///
/// `lzma-rs` (pure Rust, so CI needs no liblzma) only decodes whole streams,
/// so an `.xz` file is decompressed into memory first: fine for traces
/// (the Mooncake trace is 0.2 MB packed, 2.4 MB unpacked), not meant for
/// multi-gigabyte workload files, which should stay uncompressed.
pub fn open_lines(path: &Path) -> Result<Box<dyn BufRead + Send>> {
    let io_err = |source| WorkloadError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io_err)?;
    let mut reader = BufReader::new(file);
    if path.extension().is_some_and(|e| e == "xz") {
        let mut packed = Vec::new();
        reader.read_to_end(&mut packed).map_err(io_err)?;
        let mut plain = Vec::with_capacity(packed.len() * 8);
        lzma_rs::xz_decompress(&mut packed.as_slice(), &mut plain).map_err(|e| {
            WorkloadError::Xz {
                path: path.to_path_buf(),
                message: e.to_string(),
            }
        })?;
        Ok(Box::new(Cursor::new(plain)))
    } else {
        Ok(Box::new(reader))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_file_names_the_path() {
        let err = open_lines(Path::new("/nonexistent/x.jsonl"))
            .err()
            .expect("must fail");
        assert!(err.to_string().contains("/nonexistent/x.jsonl"), "{err}");
    }

    #[test]
    fn corrupt_xz_is_an_error() {
        let dir = std::env::temp_dir().join(format!("sy-wl-src-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("bad.jsonl.xz");
        std::fs::write(&p, b"not xz at all").unwrap();
        let err = open_lines(&p).err().expect("must fail");
        assert!(matches!(err, WorkloadError::Xz { .. }), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
