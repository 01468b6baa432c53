//! TLS for `tollgate bench`, to load a deployment whose listeners speak it (`--target
//! https://…`, `--grpc https://…`), with the client certificate a server that asks for one
//! needs. The handshake is part of each connection's setup, before a run starts; what a run
//! measures is then the cost of encrypting every request and answer, as clients pay it.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use super::args::BenchArgs;

/// How the generator speaks TLS to its target.
#[derive(Clone)]
pub(crate) struct TlsClient {
    connector: TlsConnector,
    /// The name the server's certificate must carry.
    name: ServerName<'static>,
}

impl fmt::Debug for TlsClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsClient")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl TlsClient {
    /// TLS to `host` (the target's), offering `alpn`, as the flags say: the authorities of
    /// `--tls-ca` or else the system's, the client certificate of `--tls-cert`/`--tls-key`,
    /// the name of `--tls-server-name` or else `host`.
    pub(crate) fn from_args(args: &BenchArgs, host: &str, alpn: &[u8]) -> Result<Self, String> {
        let roots = match &args.tls_ca {
            Some(path) => {
                let mut roots = RootCertStore::empty();
                for certificate in certificates(path, "--tls-ca")? {
                    roots.add(certificate).map_err(|err| {
                        format!("--tls-ca {}: not an authority: {err}", path.display())
                    })?;
                }
                roots
            }
            None => system_roots()?,
        };
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|err| format!("TLS: {err}"))?
            .with_root_certificates(roots);
        let mut config = match (&args.tls_cert, &args.tls_key) {
            (Some(cert), Some(key)) => {
                let chain = certificates(cert, "--tls-cert")?;
                let key = PrivateKeyDer::from_pem_file(key).map_err(|err| {
                    format!("--tls-key {}: no PEM private key: {err}", key.display())
                })?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|err| format!("--tls-cert and --tls-key: {err}"))?
            }
            _ => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![alpn.to_vec()];
        let name = args.tls_server_name.as_deref().unwrap_or(host);
        // An IPv6 address comes bracketed in an authority.
        let bare = name.trim_start_matches('[').trim_end_matches(']');
        let name = ServerName::try_from(bare.to_owned())
            .map_err(|_| format!("{name} is no TLS server name (see --tls-server-name)"))?;
        Ok(Self {
            connector: TlsConnector::from(Arc::new(config)),
            name,
        })
    }

    /// Makes the handshake over `stream`.
    pub(crate) async fn connect(&self, stream: TcpStream) -> std::io::Result<TlsStream<TcpStream>> {
        self.connector.connect(self.name.clone(), stream).await
    }
}

/// The certificates of the PEM file `path`, at least one.
fn certificates(path: &Path, flag: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certificates = CertificateDer::pem_file_iter(path)
        .and_then(|certificates| certificates.collect::<Result<Vec<_>, _>>())
        .map_err(|err| format!("{flag} {}: {err}", path.display()))?;
    if certificates.is_empty() {
        return Err(format!("{flag} {}: no PEM certificate", path.display()));
    }
    Ok(certificates)
}

/// The operating system's trusted authorities.
fn system_roots() -> Result<RootCertStore, String> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        return Err(
            "no trusted authorities found on this system: give the server's with --tls-ca".into(),
        );
    }
    Ok(roots)
}
