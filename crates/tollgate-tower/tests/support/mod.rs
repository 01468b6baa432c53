//! What more than one of the layer's test files needs.

use std::task::{Context, Poll};

use axum::body::Body;
use http::{Request, Response};

/// An inner service that is never ready, and says why: the layers' readiness must be its.
#[derive(Debug, Clone)]
pub(crate) struct Down;

impl tower::Service<Request<Body>> for Down {
    type Response = Response<Body>;
    type Error = &'static str;
    type Future = std::future::Ready<Result<Response<Body>, &'static str>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Err("the service is down"))
    }

    fn call(&mut self, _: Request<Body>) -> Self::Future {
        std::future::ready(Ok(Response::new(Body::empty())))
    }
}
