//! TLS on the server's own listeners, with certificates that can be replaced while it runs.
//!
//! Outside a service mesh nothing else encrypts the calls Envoy, nginx and other clients make
//! to tollgate, nor the admin token they carry; and a server that takes what its callers say
//! (hits given back, resets, policy reloads) should hear only from callers it knows. So each
//! listener can speak TLS with a certificate of its own, and can require every client to
//! present one signed by a given authority (mutual TLS), which Envoy's `UpstreamTlsContext`
//! does with a client certificate.
//!
//! Certificates are short-lived where they are managed well (cert-manager, an internal ACME
//! authority), so the files are read again while the server runs: on SIGHUP, and whenever a
//! periodic look finds their bytes changed ([`ListenerTls::reload_if_changed`]). New
//! connections get the new certificate; those open keep the one they began with. A set of
//! files that cannot be used (a key that does not match its certificate, a file written
//! halfway) is refused, logged and counted, and the certificate in force stays, as a policy
//! file that fails validation leaves the last good version. The start is stricter: files that
//! cannot be used there stop the process with one line naming the file.
//!
//! rustls with `aws-lc-rs` does the TLS (built in, no system OpenSSL), TLS 1.2 and 1.3, with
//! its safe defaults. Each listener offers its protocols by ALPN: `h2` for gRPC, `h2` then
//! `http/1.1` for HTTP (a client offering both gets HTTP/2, whose one connection carries many
//! requests at once). A client that offers no ALPN at all is served as its first bytes say
//! (on the HTTP listener, HTTP/2 when they are its preface, HTTP/1.1 otherwise, as on a plain
//! connection); one that offers only other protocols is refused in the handshake rather than
//! misread afterwards.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rustls::RootCertStore;
use rustls::ServerConfig;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use tokio_rustls::TlsAcceptor;

use crate::connection::Listener;
use crate::metrics;

/// The files a listener's TLS is made from, all PEM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The server's certificate, followed by the intermediates a client needs to reach its
    /// authority.
    pub cert: PathBuf,
    /// The certificate's private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// When set, clients must present a certificate signed by an authority in this file.
    pub client_ca: Option<PathBuf>,
}

/// Why a listener's TLS files cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A file cannot be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A certificate file holds no PEM certificate (or a broken one).
    #[error("{} holds no PEM certificate", path.display())]
    NoCertificate {
        /// The file.
        path: PathBuf,
    },
    /// A key file holds no PEM private key (or a broken one).
    #[error("{} holds no PEM private key", path.display())]
    NoKey {
        /// The file.
        path: PathBuf,
    },
    /// The key does not suit the certificate, or the certificate is unusable.
    #[error("{} and {} do not make a usable certificate: {source}", cert.display(), key.display())]
    Certificate {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// rustls' reason.
        source: rustls::Error,
    },
    /// A certificate of the client authorities cannot be trusted as one.
    #[error("{} holds a certificate that cannot be an authority: {source}", path.display())]
    ClientCa {
        /// The file.
        path: PathBuf,
        /// rustls' reason.
        source: rustls::Error,
    },
    /// The client authorities cannot verify clients.
    #[error("{} cannot verify clients: {source}", path.display())]
    ClientVerifier {
        /// The file.
        path: PathBuf,
        /// rustls' reason.
        source: rustls::server::VerifierBuilderError,
    },
}

/// The protocols a listener serves, which its TLS offers by ALPN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Alpn {
    /// HTTP/2 only, for gRPC.
    Grpc,
    /// HTTP/2 or HTTP/1.1, for the HTTP API.
    Http,
}

impl Alpn {
    /// The protocols offered, in the order the server prefers them (rustls picks the first
    /// one the client also offers).
    fn protocols(self) -> Vec<Vec<u8>> {
        match self {
            Alpn::Grpc => vec![b"h2".to_vec()],
            Alpn::Http => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
        }
    }

    /// The listener these protocols are served on.
    fn listener(self) -> Listener {
        match self {
            Alpn::Grpc => Listener::Grpc,
            Alpn::Http => Listener::Http,
        }
    }
}

/// A listener's TLS: the files, and the settings last made from them.
#[derive(Debug)]
pub struct ListenerTls {
    files: TlsFiles,
    alpn: Alpn,
    current: Mutex<Current>,
}

/// The settings in force, and the files' bytes they were made from.
#[derive(Debug)]
struct Current {
    config: Arc<ServerConfig>,
    /// When the certificate in force expires, in Unix seconds (`None`: not readable as X.509,
    /// which rustls does not need it to be).
    expires: Option<i64>,
    made_from: Contents,
    /// What the last look refused, so that files left broken are reported once, not at every
    /// look.
    refused: Option<Refused>,
}

/// Files a look refused.
#[derive(Debug, PartialEq, Eq)]
enum Refused {
    /// One could not be read.
    Unreadable,
    /// They held these bytes.
    Contents(Contents),
}

/// The bytes of a listener's files, as read together.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Contents {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

/// What a look at the files found.
#[derive(Debug)]
pub enum Reload {
    /// The files hold what the settings in force were made from, or what the last look
    /// refused (reported then).
    Unchanged,
    /// New files, now in force for new connections.
    Reloaded,
    /// New files that cannot be used: the settings in force stay.
    Refused(TlsError),
}

impl ListenerTls {
    /// The HTTP listener's TLS, made from `files`.
    ///
    /// # Errors
    ///
    /// [`TlsError`] naming the file that cannot be used.
    pub fn for_http(files: TlsFiles) -> Result<Self, TlsError> {
        Self::load(files, Alpn::Http)
    }

    /// The gRPC listener's TLS, made from `files`.
    ///
    /// # Errors
    ///
    /// [`TlsError`] naming the file that cannot be used.
    pub fn for_grpc(files: TlsFiles) -> Result<Self, TlsError> {
        Self::load(files, Alpn::Grpc)
    }

    fn load(files: TlsFiles, alpn: Alpn) -> Result<Self, TlsError> {
        let contents = read(&files)?;
        let (config, expires) = make(&files, &contents, alpn)?;
        Ok(Self {
            files,
            alpn,
            current: Mutex::new(Current {
                config,
                expires,
                made_from: contents,
                refused: None,
            }),
        })
    }

    /// The files this TLS is made from.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// When the certificate in force expires (its `notAfter`), in Unix seconds: what an alert
    /// on a renewal that never came watches.
    pub fn expires(&self) -> Option<i64> {
        self.current.lock().expires
    }

    /// The listener this TLS is for.
    pub(crate) fn listener(&self) -> Listener {
        self.alpn.listener()
    }

    /// An acceptor with the settings in force, for one connection's handshake.
    pub(crate) fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(Arc::clone(&self.current.lock().config))
    }

    /// Reads the files again and puts them in force if their bytes changed since the settings
    /// in force were made (or last refused). Cheap when nothing changed: three small reads.
    pub fn reload_if_changed(&self) -> Reload {
        self.reload_from(read(&self.files), false)
    }

    /// Reads the files again and puts them in force, changed or not; files refused before
    /// are reported again (an operator asked).
    pub fn reload(&self) -> Reload {
        self.reload_from(read(&self.files), true)
    }

    fn reload_from(&self, contents: Result<Contents, TlsError>, forced: bool) -> Reload {
        let contents = {
            let mut current = self.current.lock();
            match contents {
                Err(err) => {
                    if !forced && current.refused == Some(Refused::Unreadable) {
                        return Reload::Unchanged;
                    }
                    current.refused = Some(Refused::Unreadable);
                    return Reload::Refused(err);
                }
                Ok(contents) if !forced && contents == current.made_from => {
                    // Back to what is in force: a next refusal is news again.
                    current.refused = None;
                    return Reload::Unchanged;
                }
                Ok(contents)
                    if !forced
                        && matches!(
                            &current.refused,
                            Some(Refused::Contents(refused)) if *refused == contents
                        ) =>
                {
                    return Reload::Unchanged;
                }
                Ok(contents) => contents,
            }
        };
        // Made without the lock, which every new connection's handshake takes.
        let made = make(&self.files, &contents, self.alpn);
        let mut current = self.current.lock();
        match made {
            Ok((config, expires)) => {
                current.config = config;
                current.expires = expires;
                current.made_from = contents;
                current.refused = None;
                Reload::Reloaded
            }
            Err(err) => {
                current.refused = Some(Refused::Contents(contents));
                Reload::Refused(err)
            }
        }
    }
}

/// How often [`watch`] looks at the files: certificates are renewed well before they expire
/// (cert-manager: a third of their life before), so a few seconds late is nothing, and a look
/// that finds nothing changed costs three small reads.
pub const LOOK_EVERY: Duration = Duration::from_secs(5);

/// Looks at each listener's files every `every` and puts changed ones in force, reporting
/// each change; runs until dropped.
pub async fn watch(listeners: Vec<Arc<ListenerTls>>, every: Duration) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is immediate, and the files were read at the start.
    ticks.tick().await;
    loop {
        ticks.tick().await;
        for tls in &listeners {
            tls.report(&tls.reload_if_changed(), "files changed");
        }
    }
}

impl ListenerTls {
    /// Logs and counts what a look found, when it found a change; `cause` says what made the
    /// server look (`files changed`, `SIGHUP`).
    pub fn report(&self, outcome: &Reload, cause: &str) {
        let listener = self.listener();
        match outcome {
            Reload::Unchanged => {}
            Reload::Reloaded => {
                tracing::info!(
                    listener = listener.as_str(),
                    cert = %self.files.cert.display(),
                    "{cause}: TLS certificate reloaded; new connections use it"
                );
                metrics::record_tls_reload(listener, "reloaded");
            }
            Reload::Refused(err) => {
                tracing::warn!(
                    listener = listener.as_str(),
                    "{cause}: TLS files refused, the certificate in force stays: {err}"
                );
                metrics::record_tls_reload(listener, "refused");
            }
        }
    }
}

fn read(files: &TlsFiles) -> Result<Contents, TlsError> {
    Ok(Contents {
        cert: read_file(&files.cert)?,
        key: read_file(&files.key)?,
        client_ca: files.client_ca.as_deref().map(read_file).transpose()?,
    })
}

fn read_file(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

/// The certificates of a PEM file, at least one, each whole.
fn certificates(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certificates = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| TlsError::NoCertificate {
            path: path.to_owned(),
        })?;
    if certificates.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.to_owned(),
        });
    }
    Ok(certificates)
}

/// The settings made from `contents`, and when their certificate expires.
fn make(
    files: &TlsFiles,
    contents: &Contents,
    alpn: Alpn,
) -> Result<(Arc<ServerConfig>, Option<i64>), TlsError> {
    let chain = certificates(&files.cert, &contents.cert)?;
    let expires = chain.first().and_then(|leaf| {
        x509_parser::parse_x509_certificate(leaf)
            .ok()
            .map(|(_, parsed)| parsed.validity().not_after.timestamp())
    });
    let key = PrivateKeyDer::from_pem_slice(&contents.key).map_err(|_| TlsError::NoKey {
        path: files.key.clone(),
    })?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Certificate {
            cert: files.cert.clone(),
            key: files.key.clone(),
            source,
        })?;
    let builder = match (&files.client_ca, &contents.client_ca) {
        (Some(path), Some(pem)) => {
            builder.with_client_cert_verifier(client_verifier(path, pem, provider)?)
        }
        _ => builder.with_no_client_auth(),
    };
    let mut config =
        builder
            .with_single_cert(chain, key)
            .map_err(|source| TlsError::Certificate {
                cert: files.cert.clone(),
                key: files.key.clone(),
                source,
            })?;
    config.alpn_protocols = alpn.protocols();
    Ok((Arc::new(config), expires))
}

/// Requires every client to present a certificate signed by an authority in `pem`.
fn client_verifier(
    path: &Path,
    pem: &[u8],
    provider: Arc<CryptoProvider>,
) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>, TlsError> {
    let mut roots = RootCertStore::empty();
    for certificate in certificates(path, pem)? {
        roots
            .add(certificate)
            .map_err(|source| TlsError::ClientCa {
                path: path.to_owned(),
                source,
            })?;
    }
    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .map_err(|source| TlsError::ClientVerifier {
            path: path.to_owned(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_redis::test_server::TestCertificates;

    /// A listener's TLS over copies of `certificates`' server files in a directory of its own.
    struct Files {
        dir: PathBuf,
        tls: ListenerTls,
    }

    impl Files {
        fn new(name: &str, certificates: &TestCertificates) -> Self {
            let dir = std::env::temp_dir()
                .join(format!("tollgate-tls-unit-{name}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let files = TlsFiles {
                cert: dir.join("server.pem"),
                key: dir.join("server.key"),
                client_ca: None,
            };
            std::fs::copy(&certificates.server_cert, &files.cert).unwrap();
            std::fs::copy(&certificates.server_key, &files.key).unwrap();
            let tls = ListenerTls::for_http(files).unwrap();
            Self { dir, tls }
        }

        fn put(&self, cert: &Path, key: &Path) {
            std::fs::copy(cert, &self.tls.files.cert).unwrap();
            std::fs::copy(key, &self.tls.files.key).unwrap();
        }

        fn config(&self) -> Arc<ServerConfig> {
            Arc::clone(&self.tls.current.lock().config)
        }
    }

    impl Drop for Files {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    #[test]
    fn each_listener_offers_its_protocols_http2_first() {
        let certificates = TestCertificates::generate("unit-alpn");
        let offered = |tls: ListenerTls| tls.current.lock().config.alpn_protocols.clone();
        let paths = TlsFiles {
            cert: certificates.server_cert.clone(),
            key: certificates.server_key.clone(),
            client_ca: None,
        };
        let http = ListenerTls::for_http(paths.clone()).unwrap();
        assert_eq!(http.listener(), Listener::Http);
        assert_eq!(offered(http), [b"h2".to_vec(), b"http/1.1".to_vec()]);
        let grpc = ListenerTls::for_grpc(paths).unwrap();
        assert_eq!(grpc.listener(), Listener::Grpc);
        assert_eq!(offered(grpc), [b"h2".to_vec()]);
    }

    #[test]
    fn files_are_put_in_force_only_when_their_bytes_change() {
        let first = TestCertificates::generate("unit-change-1");
        let second = TestCertificates::generate("unit-change-2");
        let files = Files::new("change", &first);
        let before = files.config();
        assert!(matches!(files.tls.reload_if_changed(), Reload::Unchanged));
        assert!(Arc::ptr_eq(&before, &files.config()), "nothing remade");

        files.put(&second.server_cert, &second.server_key);
        assert!(matches!(files.tls.reload_if_changed(), Reload::Reloaded));
        assert!(!Arc::ptr_eq(&before, &files.config()));
        assert!(matches!(files.tls.reload_if_changed(), Reload::Unchanged));
        // Forced (SIGHUP): remade even though nothing changed.
        let current = files.config();
        assert!(matches!(files.tls.reload(), Reload::Reloaded));
        assert!(!Arc::ptr_eq(&current, &files.config()));
    }

    #[test]
    fn broken_files_are_refused_once_and_the_settings_in_force_stay() {
        let first = TestCertificates::generate("unit-broken-1");
        let second = TestCertificates::generate("unit-broken-2");
        let files = Files::new("broken", &first);
        let in_force = files.config();

        // A certificate with another's key.
        files.put(&first.server_cert, &second.server_key);
        let refused = files.tls.reload_if_changed();
        assert!(
            matches!(refused, Reload::Refused(TlsError::Certificate { .. })),
            "{refused:?}"
        );
        assert!(
            Arc::ptr_eq(&in_force, &files.config()),
            "the old settings stay"
        );
        // The same broken bytes again: already reported.
        assert!(matches!(files.tls.reload_if_changed(), Reload::Unchanged));
        // An operator asking (SIGHUP) hears of it again.
        assert!(matches!(files.tls.reload(), Reload::Refused(_)));

        // A file gone (mid-replacement): reported once.
        std::fs::remove_file(&files.tls.files.key).unwrap();
        assert!(matches!(
            files.tls.reload_if_changed(),
            Reload::Refused(TlsError::Read { .. })
        ));
        assert!(matches!(files.tls.reload_if_changed(), Reload::Unchanged));

        // Back to the bytes in force: nothing to do, and a later refusal is news again.
        files.put(&first.server_cert, &first.server_key);
        assert!(matches!(files.tls.reload_if_changed(), Reload::Unchanged));
        files.put(&first.server_cert, &second.server_key);
        assert!(matches!(files.tls.reload_if_changed(), Reload::Refused(_)));
        assert!(Arc::ptr_eq(&in_force, &files.config()));

        // Mended: in force.
        files.put(&second.server_cert, &second.server_key);
        assert!(matches!(files.tls.reload_if_changed(), Reload::Reloaded));
    }

    #[test]
    fn the_certificate_in_force_says_when_it_expires() {
        use rcgen::{CertificateParams, KeyPair, date_time_ymd};

        let dir = std::env::temp_dir().join(format!("tollgate-tls-expiry-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |expires: (i32, u8, u8)| {
            let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
            params.not_after = date_time_ymd(expires.0, expires.1, expires.2);
            let key = KeyPair::generate().unwrap();
            let cert = params.self_signed(&key).unwrap();
            std::fs::write(dir.join("cert.pem"), cert.pem()).unwrap();
            std::fs::write(dir.join("key.pem"), key.serialize_pem()).unwrap();
        };
        write((2031, 5, 17));
        let tls = ListenerTls::for_grpc(TlsFiles {
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
            client_ca: None,
        })
        .unwrap();
        // 2031-05-17T00:00:00Z.
        assert_eq!(tls.expires(), Some(1_936_742_400));
        // Renewed: the new certificate's date, once in force.
        write((2032, 1, 1));
        assert!(matches!(tls.reload_if_changed(), Reload::Reloaded));
        assert_eq!(tls.expires(), Some(1_956_528_000));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn client_authorities_must_hold_a_certificate() {
        let certificates = TestCertificates::generate("unit-ca");
        let files = TlsFiles {
            cert: certificates.server_cert.clone(),
            key: certificates.server_key.clone(),
            client_ca: Some(certificates.server_key.clone()),
        };
        let err = ListenerTls::for_grpc(files).unwrap_err();
        assert!(matches!(err, TlsError::NoCertificate { .. }), "{err:?}");
        assert!(
            err.to_string()
                .contains(&certificates.server_key.display().to_string()),
            "{err}"
        );
        let files = TlsFiles {
            cert: certificates.server_cert.clone(),
            key: certificates.server_key.clone(),
            client_ca: Some(certificates.ca.clone()),
        };
        assert!(ListenerTls::for_grpc(files).is_ok());
    }
}
