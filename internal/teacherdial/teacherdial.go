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
	"io/fs"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"
)

// ErrInvalid marks a bad address, token file or CA file: every such
// error is an *OptionError, which names the option and what it wants.
var ErrInvalid = errors.New("teacherdial: invalid option")

// Option is one input of Dial or ReadToken.
type Option string

// The options, under their default names in errors.
const (
	Address   Option = "teacher address"
	CAFile    Option = "TLS CA file"
	TokenFile Option = "token file"
)

// OptionError is a bad option: it names the option as the user set it
// (Options.Names, ReadToken's name: a flag such as --tls-ca, a config
// key such as distill.tls_ca; else the Option itself), its value, what
// is wrong and what it wants: "--tls-ca ca.pem: no such file or
// directory: give the PEM file of the CA ...". It is ErrInvalid, whose
// text it does not repeat.
type OptionError struct {
	Option Option
	msg    string
}

func (e *OptionError) Error() string        { return e.msg }
func (e *OptionError) Is(target error) bool { return target == ErrInvalid }

// optionErr is the *OptionError of option o, named name ("": o).
func optionErr(o Option, name, format string, a ...any) error {
	if name == "" {
		name = string(o)
	}
	return &OptionError{Option: o, msg: name + " " + fmt.Sprintf(format, a...)}
}

// fileProblem is what went wrong reading a file, without the path the
// message names already ("no such file or directory", not "open f: no
// such file or directory").
func fileProblem(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}

// MaxReconnectDelay bounds the wait between two attempts to connect to
// a daemon that did not answer.
const MaxReconnectDelay = 5 * time.Second

// KeepaliveTime and KeepaliveTimeout are the pings of a connection with
// calls open: after KeepaliveTime with nothing from the daemon, a ping;
// with no answer within KeepaliveTimeout, the connection is closed and
// its calls fail (Unavailable; Message says the daemon stopped
// answering). A daemon that is hung, or whose machine or network is gone
// without closing the connection, sends nothing, not even a TCP reset:
// without the pings a call to it (a fill's chunk, an online student's
// Score stream) waited for ever. A daemon at work answers them however
// long its forward takes. gRPC pings no more often than every 10s; a
// daemon accepts pings every MinPingInterval. Variables for tests.
var (
	KeepaliveTime    = 30 * time.Second
	KeepaliveTimeout = 20 * time.Second
)

// MinPingInterval is how often a daemon lets a client ping (its
// keepalive enforcement policy): below gRPC's least client interval, so
// that no client's pings are refused. gRPC's default, 5 minutes, closed
// the connection of a client pinging more often ("too_many_pings") in
// the middle of a long chunk.
const MinPingInterval = 5 * time.Second

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
	// Names name the options in errors as the user set them (Address:
	// "--teacher", CAFile: "--tls-ca"); an option not here goes by its
	// Option name.
	Names map[Option]string
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
		const want = "give the PEM file of the CA that signed the daemon's TLS certificate (teacherd --tls-cert), or no CA file to connect without TLS"
		pem, err := os.ReadFile(o.CAFile)
		if err != nil {
			return nil, optionErr(CAFile, o.Names[CAFile], "%s: %v: %s", o.CAFile, fileProblem(err), want)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, optionErr(CAFile, o.Names[CAFile], "%s holds no PEM certificate: %s", o.CAFile, want)
		}
		creds = credentials.NewTLS(&tls.Config{RootCAs: pool, ServerName: o.ServerName, MinVersion: tls.VersionTLS12})
	}
	// A daemon that is not up yet (a fill or a student started beside
	// it) is dialed again within MaxReconnectDelay of when it listens:
	// gRPC's default backoff grows to 2 minutes between attempts, and a
	// caller waiting for the daemon would wait that long after it is up.
	bo := backoff.DefaultConfig
	bo.MaxDelay = MaxReconnectDelay
	opts := []grpc.DialOption{grpc.WithTransportCredentials(creds), grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(MaxRecvBytes)),
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: bo, MinConnectTimeout: 20 * time.Second}),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: KeepaliveTime, Timeout: KeepaliveTimeout})}
	if o.Token != "" {
		opts = append(opts, grpc.WithPerRPCCredentials(tokenCreds(o.Token)))
	}
	conn, err := grpc.NewClient(addr, opts...)
	if err != nil {
		return nil, optionErr(Address, o.Names[Address], "%q: %v: want a daemon's host:port (teacherd --listen)", addr, err)
	}
	return conn, nil
}

// ReadToken reads a bearer token from a file (teacherd's --token-file, a
// rendezvous token), trimmed of surrounding white space; an empty file
// is an error. name is
// how the user gave the path, for errors (a flag such as --token-file, a
// config key, an environment variable; "": "token file").
func ReadToken(path, name string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", optionErr(TokenFile, name, "%s: %v: give the file that holds the bearer token", path, fileProblem(err))
	}
	t := strings.TrimSpace(string(b))
	if t == "" {
		return "", optionErr(TokenFile, name, "%s is empty: write the bearer token into it", path)
	}
	return t, nil
}

// Message is a failed call's error as a user reads it: the daemon's own
// message without gRPC's "rpc error: code = ... desc = ..." wrapper, and
// for a connection that failed, what happened to it instead of gRPC's
// transport wording ("connection error: desc = \"transport: Error while
// dialing: ...\"", "closing transport due to: ... received prior goaway:
// ... graceful_stop"). The code, where a caller shows it, is
// status.Code(err).
func Message(err error) string {
	st, ok := status.FromError(err)
	if !ok {
		return err.Error()
	}
	m := st.Message()
	if st.Code() != codes.Unavailable {
		return m
	}
	switch {
	case strings.Contains(m, `debug data: "graceful_stop"`):
		return "the daemon is shutting down (SIGTERM or Ctrl-C) and closed the connection"
	case strings.Contains(m, "error reading from server: EOF"):
		return "the connection was lost: the daemon stopped or crashed, or the network dropped"
	case strings.Contains(m, "keepalive ping failed to receive ACK"):
		return fmt.Sprintf("the daemon stopped answering (no reply to a keepalive ping within %s): it hangs, or its machine or the network is down", KeepaliveTimeout)
	}
	if rest, ok := strings.CutPrefix(m, `connection error: desc = "`); ok {
		rest = strings.TrimSuffix(rest, `"`)
		rest = strings.TrimPrefix(rest, "transport: ")
		if d, ok := strings.CutPrefix(rest, "Error while dialing: "); ok {
			return "cannot connect: " + d
		}
		return rest
	}
	return m
}
