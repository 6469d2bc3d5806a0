// Package middleware is an net/http middleware that asks Tollgate before
// letting a request through.
//
// Generate the client from the repository's proto first:
//
//	protoc -I ../../proto --go_out=. --go_opt=module=example.com/tollgate-middleware \
//	    --go-grpc_out=. --go-grpc_opt=module=example.com/tollgate-middleware \
//	    --go_opt=Mtollgate/v1/tollgate.proto=example.com/tollgate-middleware/tollgatev1 \
//	    --go-grpc_opt=Mtollgate/v1/tollgate.proto=example.com/tollgate-middleware/tollgatev1 \
//	    tollgate/v1/tollgate.proto
//
// Allowed requests carry the RateLimit header fields Tollgate returns; rejected
// ones get an honest 429 with Retry-After. If Tollgate cannot be reached the
// request goes through (fail open): the limiter must not become the outage.
package middleware

import (
	"context"
	"log"
	"net/http"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	tollgatev1 "example.com/tollgate-middleware/tollgatev1"
)

// Limiter wraps handlers with a ShouldAllow call.
type Limiter struct {
	client  tollgatev1.RateLimiterClient
	Tenant  string
	Key     func(*http.Request) string
	Timeout time.Duration
}

// New connects to Tollgate at target (host:port).
func New(target, tenant string, key func(*http.Request) string) (*Limiter, error) {
	conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	return &Limiter{client: tollgatev1.NewRateLimiterClient(conn), Tenant: tenant, Key: key, Timeout: 50 * time.Millisecond}, nil
}

// Wrap returns next behind the limiter.
func (l *Limiter) Wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := l.Key(r)
		if key == "" {
			http.Error(w, "missing API key", http.StatusBadRequest)
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), l.Timeout)
		defer cancel()
		decision, err := l.client.ShouldAllow(ctx, &tollgatev1.ShouldAllowRequest{Key: key, Tenant: l.Tenant, Cost: 1})
		if err != nil {
			log.Printf("tollgate unavailable (%v); letting the request through", err)
			next.ServeHTTP(w, r)
			return
		}
		for name, value := range decision.GetHeaders() {
			w.Header().Set(name, value)
		}
		if !decision.GetAllowed() {
			http.Error(w, "rate limited; retry after the Retry-After header", http.StatusTooManyRequests)
			return
		}
		next.ServeHTTP(w, r)
	})
}
