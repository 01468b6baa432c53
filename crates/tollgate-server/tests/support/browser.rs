//! A headless Chromium driven over WebDriver (chromedriver, through fantoccini), for the tests
//! that must run a page's script rather than read its text: the dashboard is a script that
//! parses `/metrics` and draws what it finds, and only a browser shows whether it does.
//!
//! chromedriver starts in a process group of its own; the browser it starts joins that group,
//! and dropping a [`Browser`] kills the whole group, so a failing test leaves no browser
//! behind. Missing Chromium or chromedriver is a setup error with what to install, never a
//! skip.

use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fantoccini::{Client, ClientBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::{Value, json};

use super::Scratch;

/// What to install when the browser is missing.
const SETUP: &str = "these tests need Chromium and chromedriver (Debian: apt-get install -y \
                     chromium chromium-driver; .ci/run installs them), or their paths in \
                     TOLLGATE_CHROMIUM and TOLLGATE_CHROMEDRIVER";

/// A headless Chromium session, closed (and its processes killed) on drop.
pub struct Browser {
    client: Option<Client>,
    driver: Child,
    /// The browser's profile, new for each session: nothing carries over between tests.
    profile: Scratch,
}

impl Browser {
    /// Starts chromedriver on a free loopback port and opens a headless session on it.
    pub async fn open() -> Self {
        // A driver that takes the session request and closes the connection unanswered (seen
        // on a machine's first run, every core busy compiling and testing) is no setup error:
        // another is started, on another port, twice at most.
        let mut last = String::new();
        for _ in 0..3 {
            match Self::try_open().await {
                Ok(browser) => return browser,
                Err(err) => last = err,
            }
        }
        panic!("no browser session ({last}): {SETUP}");
    }

    async fn try_open() -> Result<Self, String> {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("a free port")
            .port();
        let driver_path =
            std::env::var_os("TOLLGATE_CHROMEDRIVER").unwrap_or_else(|| "chromedriver".into());
        let driver = Command::new(&driver_path)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap_or_else(|err| panic!("cannot run {driver_path:?} ({err}): {SETUP}"));
        let profile = Scratch::new("browser-profile");
        let mut browser = Self {
            client: None,
            driver,
            profile,
        };
        let mut options = json!({
            "args": [
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-crash-reporter",
                "--window-size=1280,900",
                format!("--user-data-dir={}", super::path_str(&browser.profile.0)),
            ]
        });
        if let Some(binary) = std::env::var_os("TOLLGATE_CHROMIUM") {
            options["binary"] = Value::String(binary.to_string_lossy().into_owned());
        }
        let mut capabilities = serde_json::Map::new();
        capabilities.insert("goog:chromeOptions".into(), options);
        // chromedriver takes a moment to listen (seconds, on a cold, busy machine); one that
        // exits instead (no Chromium where it looks, say) fails the test at once.
        for _ in 0..300 {
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            if let Ok(Some(status)) = browser.driver.try_wait() {
                panic!("chromedriver exited ({status}): {SETUP}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let client = ClientBuilder::new(HttpConnector::new())
            .capabilities(capabilities)
            .connect(&format!("http://127.0.0.1:{port}"))
            .await
            .map_err(|err| err.to_string())?;
        browser.client = Some(client);
        Ok(browser)
    }

    /// The WebDriver session.
    pub fn client(&self) -> &Client {
        self.client.as_ref().expect("an open session")
    }

    /// Opens `url` in the session's window.
    pub async fn visit(&self, url: &str) {
        self.client()
            .goto(url)
            .await
            .unwrap_or_else(|err| panic!("cannot open {url}: {err}"));
    }

    /// Runs `script` (a function body; `return` gives its value) in the page.
    pub async fn run(&self, script: &str) -> Value {
        self.client()
            .execute(script, Vec::new())
            .await
            .unwrap_or_else(|err| panic!("the page's script failed ({err}): {script}"))
    }

    /// Reads the page with `script` every 100 ms, for up to 15 s, until `done` holds for what
    /// it read; returns that. Panics with `what` and the last reading otherwise: the page
    /// refreshes on its own timer, so a test waits for what it should come to show.
    pub async fn wait_until(
        &self,
        what: &str,
        script: &str,
        done: impl Fn(&Value) -> bool,
    ) -> Value {
        let mut last = Value::Null;
        for _ in 0..150 {
            last = self.run(script).await;
            if done(&last) {
                return last;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("{what} never came within 15 s; the page last showed {last:#}");
    }

    /// Ends the session (Chromium quits), then stops chromedriver.
    pub async fn close(mut self) {
        if let Some(client) = self.client.take() {
            let _ = client.close().await;
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // The group is chromedriver's own (`process_group(0)`): it and the browser it started.
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.driver.id())])
            .stderr(Stdio::null())
            .status();
        let _ = self.driver.wait();
    }
}
