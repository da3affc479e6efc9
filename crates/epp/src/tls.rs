//! TLS on the ext_proc port, as GIE's reference picker serves it (`--secure-serving`): a
//! certificate and key from `--cert-path` (`tls.crt` and `tls.key`, a Kubernetes TLS secret's
//! names), or a self-signed certificate made at start-up. Gateways that speak TLS to the picker
//! do not verify it (Istio's guide sets `insecureSkipVerify`), so self-signed is enough for them.

use std::path::{Path, PathBuf};

use tonic::transport::{Identity, ServerTlsConfig};

use crate::EppError;

/// Where the ext_proc port's certificate comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TlsSettings {
    /// Made at start-up, for `switchyard-epp` and `localhost`.
    SelfSigned,
    /// `tls.crt` and `tls.key` (PEM) in this directory.
    Files(PathBuf),
}

/// The server's TLS configuration for `settings`.
pub fn server_config(settings: &TlsSettings) -> Result<ServerTlsConfig, EppError> {
    let (cert, key) = match settings {
        TlsSettings::SelfSigned => self_signed()?,
        TlsSettings::Files(dir) => (read(dir, "tls.crt")?, read(dir, "tls.key")?),
    };
    Ok(ServerTlsConfig::new().identity(Identity::from_pem(cert, key)))
}

fn read(dir: &Path, name: &str) -> Result<Vec<u8>, EppError> {
    let path = dir.join(name);
    std::fs::read(&path).map_err(|e| EppError::Tls(format!("{}: {e}", path.display())))
}

fn self_signed() -> Result<(Vec<u8>, Vec<u8>), EppError> {
    let names = vec!["switchyard-epp".to_string(), "localhost".to_string()];
    let made = rcgen::generate_simple_self_signed(names)
        .map_err(|e| EppError::Tls(format!("self-signed certificate: {e}")))?;
    Ok((
        made.cert.pem().into_bytes(),
        made.signing_key.serialize_pem().into_bytes(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_self_signed_identity_is_made() {
        assert!(server_config(&TlsSettings::SelfSigned).is_ok());
    }

    #[test]
    fn missing_files_name_the_path() {
        let dir = PathBuf::from("/nonexistent/switchyard-certs");
        let err = server_config(&TlsSettings::Files(dir))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("/nonexistent/switchyard-certs/tls.crt"),
            "{err}"
        );
    }
}
