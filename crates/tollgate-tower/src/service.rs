//! The rate-limited service: decides each request, then calls the inner service or answers.
//!
//! Readiness is the inner service's alone: the limiter never applies back-pressure. A request
//! over its limit is answered at once with a 429 (tower's own `RateLimit` instead makes callers
//! wait, which turns a quota into queued latency and hides it from the client).

use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use crate::extract::RequestHead;
use crate::future::{ResponseBody, ResponseFuture, with_headers};
use crate::limiter::{Shared, Step, Verdict, for_grpc, is_grpc};

/// A service behind tollgate: made by [`TollgateLayer`](crate::TollgateLayer). Every clone
/// shares the layer's limiter.
pub struct Tollgate<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> Tollgate<S> {
    pub(crate) fn new(inner: S, shared: Arc<Shared>) -> Self {
        Self { inner, shared }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The wrapped service, unwrapped.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone> Clone for Tollgate<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: std::fmt::Debug> std::fmt::Debug for Tollgate<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tollgate")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Tollgate<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Send + 'static,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<ReqBody>) -> Self::Future {
        let head = RequestHead::of(&request);
        let grpc = is_grpc(&head);
        let answer = move |response| if grpc { for_grpc(response) } else { response };
        let step = self.shared.start(&head);
        match step {
            Step::Done(Verdict::Allow(headers, reservation)) => {
                if let Some(reservation) = reservation {
                    request.extensions_mut().insert(reservation);
                }
                ResponseFuture::called(self.inner.call(request), headers)
            }
            Step::Done(Verdict::Answer(response)) => ResponseFuture::answered(answer(response)),
            Step::Pending(pending) => {
                // The service that was made ready goes into the future; this one keeps a
                // fresh clone, which is polled ready before its own next call.
                let clone = self.inner.clone();
                let mut inner = std::mem::replace(&mut self.inner, clone);
                let shared = Arc::clone(&self.shared);
                ResponseFuture::deciding(Box::pin(async move {
                    match shared.finish(pending).await {
                        Verdict::Allow(headers, reservation) => {
                            let mut request = request;
                            if let Some(reservation) = reservation {
                                request.extensions_mut().insert(reservation);
                            }
                            let response = inner.call(request).await?;
                            Ok(with_headers(response, headers))
                        }
                        Verdict::Answer(response) => Ok(answer(response).map(ResponseBody::denied)),
                    }
                }))
            }
        }
    }
}
