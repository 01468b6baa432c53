//! TLS for `rediss://` stores: which certificate authorities to trust, and the client
//! certificate a server may require.
//!
//! Managed Redis services (and any Redis reached across a network someone else runs) speak TLS
//! only, often with a private certificate authority, and Redis itself asks TLS clients for a
//! certificate unless told otherwise (`tls-auth-clients`). The files are read once, when the
//! store connects, so a missing or unreadable one stops the process at start with its path,
//! not at the first decision. rustls does the TLS, with `aws-lc-rs` for its cryptography
//! (built in, no system OpenSSL to match at run time), which offers Redis a post-quantum key
//! exchange (X25519MLKEM768) beside the classical ones, for the servers that speak it.

use std::path::{Path, PathBuf};

use redis::{ClientTlsConfig, TlsCertificates};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

use crate::store::ConnectError;

/// Certificate files for a TLS connection to Redis, all PEM. Without a CA file the system's
/// trusted authorities are used.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TlsFiles {
    /// The certificate authorities to trust instead of the system's.
    pub ca: Option<PathBuf>,
    /// A client certificate, for a Redis that requires one; needs [`TlsFiles::client_key`].
    pub client_cert: Option<PathBuf>,
    /// The client certificate's private key.
    pub client_key: Option<PathBuf>,
}

impl TlsFiles {
    /// No files: the system's authorities, no client certificate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Trusts the authorities in `ca` instead of the system's.
    #[must_use]
    pub fn with_ca(mut self, ca: impl Into<PathBuf>) -> Self {
        self.ca = Some(ca.into());
        self
    }

    /// Presents `cert` (proved with `key`) to the server.
    #[must_use]
    pub fn with_client_cert(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.client_cert = Some(cert.into());
        self.client_key = Some(key.into());
        self
    }

    /// Whether any file is set.
    pub fn is_empty(&self) -> bool {
        self.ca.is_none() && self.client_cert.is_none() && self.client_key.is_none()
    }

    /// Reads the files into what the client takes; `None` when none is set.
    pub(crate) fn load(&self) -> Result<Option<TlsCertificates>, ConnectError> {
        if self.is_empty() {
            return Ok(None);
        }
        let client_tls = match (&self.client_cert, &self.client_key) {
            (Some(cert), Some(key)) => Some(ClientTlsConfig {
                client_cert: read_certificates(cert)?,
                client_key: read(key)?,
            }),
            (None, None) => None,
            _ => return Err(ConnectError::TlsClientPair),
        };
        let root_cert = self.ca.as_deref().map(read_certificates).transpose()?;
        Ok(Some(TlsCertificates {
            client_tls,
            root_cert,
        }))
    }
}

/// Reads a PEM file that must hold at least one certificate: the client would skip anything
/// else in it silently, and trust nothing (or present nothing) without saying why.
fn read_certificates(path: &Path) -> Result<Vec<u8>, ConnectError> {
    let pem = read(path)?;
    match CertificateDer::pem_slice_iter(&pem).next() {
        Some(Ok(_)) => Ok(pem),
        _ => Err(ConnectError::TlsNoCertificate {
            path: path.to_owned(),
        }),
    }
}

fn read(path: &Path) -> Result<Vec<u8>, ConnectError> {
    std::fs::read(path).map_err(|source| ConnectError::TlsFile {
        path: path.to_owned(),
        source,
    })
}

/// Makes `aws-lc-rs` the process' rustls provider unless one is set already (by the embedding
/// program, or an earlier store): the client builds its TLS settings on that default.
pub(crate) fn install_provider() {
    // An error means a provider is installed already, which is as good.
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_certificate_needs_its_key() {
        let files = TlsFiles {
            client_cert: Some("cert.pem".into()),
            ..TlsFiles::default()
        };
        assert!(matches!(files.load(), Err(ConnectError::TlsClientPair)));
    }

    #[test]
    fn a_missing_file_is_named() {
        let files = TlsFiles::new().with_ca("/nonexistent/tollgate-ca.pem");
        match files.load() {
            Err(err @ ConnectError::TlsFile { .. }) => {
                assert!(
                    err.to_string().contains("/nonexistent/tollgate-ca.pem"),
                    "{err}"
                );
            }
            other => panic!("expected a file error, got {other:?}"),
        }
    }

    #[test]
    fn the_provider_offers_a_post_quantum_key_exchange_first() {
        install_provider();
        let provider = rustls::crypto::CryptoProvider::get_default();
        let groups: Vec<_> = provider
            .map(|p| p.kx_groups.iter().map(|g| g.name()).collect())
            .unwrap_or_default();
        assert_eq!(
            groups.first(),
            Some(&rustls::NamedGroup::X25519MLKEM768),
            "{groups:?}"
        );
        assert!(groups.contains(&rustls::NamedGroup::X25519), "{groups:?}");
    }

    #[test]
    fn no_files_means_the_system_authorities() {
        assert!(matches!(TlsFiles::new().load(), Ok(None)));
    }
}
