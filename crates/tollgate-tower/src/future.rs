//! The response future and body of the rate-limited service.
//!
//! A request the limiter lets through becomes the inner service's future, with the rate-limit
//! headers added to its response; a denied one is a finished response that never touches the
//! inner service; one waiting on a shared store is a boxed future that decides, then calls.
//! The body type carries either the inner service's body or the limiter's own short answer.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::Response;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::headers::{RATELIMIT, RATELIMIT_POLICY, X_RATELIMIT_REMAINING, X_RATELIMIT_RESET};
use crate::limiter::Headers;

pub(crate) type BoxResponseFuture<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send>>;

pin_project! {
    /// The future of [`Tollgate`](crate::Tollgate)'s response.
    ///
    /// # Panics
    ///
    /// When polled again after it completed, like most futures.
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        // Admitted: the inner service is answering.
        Called {
            #[pin]
            future: F,
            headers: Headers,
        },
        // Answered by the limiter (denied, or a bad request).
        Answered {
            response: Option<Response<ResponseBody<B>>>,
        },
        // Deciding on a shared store, then calling the inner service.
        Deciding {
            future: BoxResponseFuture<B, E>,
        },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(crate) fn called(future: F, headers: Headers) -> Self {
        Self {
            kind: Kind::Called { future, headers },
        }
    }

    pub(crate) fn answered(response: Response<Bytes>) -> Self {
        Self {
            kind: Kind::Answered {
                response: Some(response.map(ResponseBody::denied)),
            },
        }
    }

    pub(crate) fn deciding(future: BoxResponseFuture<B, E>) -> Self {
        Self {
            kind: Kind::Deciding { future },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Called { future, headers } => {
                let response = ready!(future.poll(cx))?;
                Poll::Ready(Ok(with_headers(response, std::mem::take(headers))))
            }
            KindProj::Answered { response } => Poll::Ready(Ok(response
                .take()
                .expect("ResponseFuture polled after completion"))),
            KindProj::Deciding { future } => future.as_mut().poll(cx),
        }
    }
}

/// The inner service's response, with the rate-limit fields added. The draft's are Structured
/// Field Lists, so lines added by another limiter (an inner layer, the service itself) combine
/// with ours into one list rather than being overwritten. The `X-RateLimit-*` fields hold one
/// limit: ours replace another limiter's only when we have fewer tokens left.
pub(crate) fn with_headers<B>(
    response: Response<B>,
    headers: Headers,
) -> Response<ResponseBody<B>> {
    let mut response = response.map(ResponseBody::inner);
    let map = response.headers_mut();
    if let Some((policy, ratelimit)) = headers.ietf {
        map.append(RATELIMIT_POLICY, policy);
        map.append(RATELIMIT, ratelimit);
    }
    if let Some(fields) = headers.x {
        let theirs = map
            .get(X_RATELIMIT_REMAINING)
            .and_then(|value| value.to_str().ok()?.parse::<u64>().ok());
        if theirs.is_none_or(|theirs| fields.remaining < theirs) {
            map.remove(X_RATELIMIT_RESET);
            for (name, value) in fields.fields() {
                map.insert(name, value);
            }
        }
    }
    response
}

pin_project! {
    /// The body of [`Tollgate`](crate::Tollgate)'s responses: the inner service's, or the
    /// limiter's own (a short `application/problem+json` document).
    pub struct ResponseBody<B> {
        #[pin]
        kind: BodyKind<B>,
    }
}

pin_project! {
    #[project = BodyProj]
    enum BodyKind<B> {
        Inner {
            #[pin]
            body: B,
        },
        Denied {
            data: Option<Bytes>,
        },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        Self {
            kind: BodyKind::Inner { body },
        }
    }

    pub(crate) fn denied(data: Bytes) -> Self {
        Self {
            kind: BodyKind::Denied {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        match self.project().kind.project() {
            BodyProj::Inner { body } => body.poll_frame(cx),
            BodyProj::Denied { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            BodyKind::Inner { body } => body.is_end_stream(),
            BodyKind::Denied { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            BodyKind::Inner { body } => body.size_hint(),
            BodyKind::Denied { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Servers size and end responses by what the body says of itself (a `content-length`, no
    /// chunked trailer on an empty body): the wrapper says what the body it wraps would.
    #[test]
    fn a_body_tells_its_size_and_its_end() {
        let inner = ResponseBody::inner(String::from("hello"));
        assert!(!inner.is_end_stream());
        assert_eq!(inner.size_hint().exact(), Some(5));
        let empty = ResponseBody::inner(String::new());
        assert!(empty.is_end_stream());
        assert_eq!(empty.size_hint().exact(), Some(0));
        let denied = ResponseBody::<String>::denied(Bytes::from_static(b"{}"));
        assert!(!denied.is_end_stream());
        assert_eq!(denied.size_hint().exact(), Some(2));
        let bare = ResponseBody::<String>::denied(Bytes::new());
        assert!(bare.is_end_stream());
        assert_eq!(bare.size_hint().exact(), Some(0));
    }
}
