# The tollgate image: the release binary on a distroless base (glibc, CA certificates for
# rediss://, no shell), run as an unprivileged user. Used by deploy/kubernetes/tollgate.yaml:
#   docker build -t registry.example.com/tollgate:0.1.0 .
# Its default command serves the built-in demo policy on all interfaces; give `serve` flags
# (or TOLLGATE_* variables) to run your own.

FROM docker.io/library/rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p tollgate-server

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/tollgate /usr/local/bin/tollgate
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["/usr/local/bin/tollgate"]
CMD ["serve", "--http", "0.0.0.0:8080", "--grpc", "0.0.0.0:8081"]
