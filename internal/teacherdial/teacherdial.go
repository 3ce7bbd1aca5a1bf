// Package teacherdial opens gRPC connections to teacherd daemons with the
// client side of their auth and TLS: a bearer token sent as
// "authorization: Bearer <token>", and TLS trusting a PEM CA file. It is
// shared by `cachectl fill` (package serve's Dial) and the student's
// online KD (package train/trainer), so both speak to a daemon alike.
package teacherdial

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// ErrInvalid marks a bad address, token file or CA file.
var ErrInvalid = errors.New("teacherdial: invalid option")

// MaxRecvBytes bounds a response (a long sample's top-k is large).
const MaxRecvBytes = 256 << 20

// Options configure Dial.
type Options struct {
	// Token is sent as "authorization: Bearer <token>" when set.
	Token string
	// CAFile enables TLS, trusting the PEM certificates in it.
	CAFile string
	// ServerName overrides the TLS server name (default: the address host).
	ServerName string
}

// tokenCreds sends the bearer token. It does not insist on TLS so that a
// token also guards a loopback daemon; over a network, use TLS.
type tokenCreds string

func (t tokenCreds) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(t)}, nil
}
func (tokenCreds) RequireTransportSecurity() bool { return false }

// Dial returns a lazy connection to the daemon at addr: errors show up on
// the first call.
func Dial(addr string, o Options) (*grpc.ClientConn, error) {
	creds := insecure.NewCredentials()
	if o.CAFile != "" {
		pem, err := os.ReadFile(o.CAFile)
		if err != nil {
			return nil, fmt.Errorf("%w: TLS CA file: %v", ErrInvalid, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%w: TLS CA file %s holds no PEM certificate", ErrInvalid, o.CAFile)
		}
		creds = credentials.NewTLS(&tls.Config{RootCAs: pool, ServerName: o.ServerName, MinVersion: tls.VersionTLS12})
	}
	opts := []grpc.DialOption{grpc.WithTransportCredentials(creds), grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(MaxRecvBytes))}
	if o.Token != "" {
		opts = append(opts, grpc.WithPerRPCCredentials(tokenCreds(o.Token)))
	}
	conn, err := grpc.NewClient(addr, opts...)
	if err != nil {
		return nil, fmt.Errorf("%w: teacher address %q: %v", ErrInvalid, addr, err)
	}
	return conn, nil
}

// ReadToken reads a bearer token from a file (teacherd's --token-file),
// trimmed of surrounding white space; an empty file is an error.
func ReadToken(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("%w: token file: %v", ErrInvalid, err)
	}
	t := strings.TrimSpace(string(b))
	if t == "" {
		return "", fmt.Errorf("%w: token file %s is empty: write the daemon's bearer token into it", ErrInvalid, path)
	}
	return t, nil
}
