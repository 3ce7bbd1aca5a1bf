package teacherdial

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"
)

// TestOptionErrors: a bad CA file, token file or address names the
// option as the caller's user set it (a flag, a config key; else the
// option's own name), the value, what is wrong and what it wants. They
// read "teacherdial: invalid option: TLS CA file: open ...": the
// package, and no option a user could find.
func TestOptionErrors(t *testing.T) {
	dir := t.TempDir()
	missing := filepath.Join(dir, "none.pem")
	notPEM := filepath.Join(dir, "ca.txt")
	empty := filepath.Join(dir, "token")
	os.WriteFile(notPEM, []byte("hello"), 0o644)
	os.WriteFile(empty, []byte(" \n"), 0o600)
	names := map[Option]string{Address: "--teacher", CAFile: "--tls-ca"}
	dial := func(addr string, o Options) error {
		c, err := Dial(addr, o)
		if err == nil {
			c.Close()
		}
		return err
	}
	token := func(path, name string) error { _, err := ReadToken(path, name); return err }
	for _, c := range []struct {
		err    error
		option Option
		want   string
	}{
		{dial("h:1", Options{CAFile: missing, Names: names}), CAFile,
			"--tls-ca " + missing + ": no such file or directory: give the PEM file of the CA that signed the daemon's TLS certificate (teacherd --tls-cert), or no CA file to connect without TLS"},
		{dial("h:1", Options{CAFile: notPEM}), CAFile, "TLS CA file " + notPEM + " holds no PEM certificate: give the PEM file of the CA"},
		{dial("%zz", Options{Names: names}), Address, `--teacher "%zz": `},
		{dial("%zz", Options{}), Address, `teacher address "%zz": `},
		{token(missing, "--token-file"), TokenFile, "--token-file " + missing + ": no such file or directory: give the file that holds the bearer token"},
		{token(empty, "distill.token_file"), TokenFile, "distill.token_file " + empty + " is empty: write the bearer token into it"},
		{token(empty, ""), TokenFile, "token file " + empty + " is empty"},
	} {
		var oe *OptionError
		if !errors.Is(c.err, ErrInvalid) || !errors.As(c.err, &oe) || oe.Option != c.option || !strings.HasPrefix(c.err.Error(), c.want) ||
			strings.Contains(c.err.Error(), "invalid option") || strings.Contains(c.err.Error(), "open ") {
			t.Errorf("%v (option %v), want ErrInvalid of %s starting %q", c.err, oe, c.option, c.want)
		}
	}
	if !strings.HasSuffix(dial("%zz", Options{}).Error(), "want a daemon's host:port (teacherd --listen)") {
		t.Errorf("a bad address does not say what it wants: %v", dial("%zz", Options{}))
	}
}

// TestMessage: a failed call reads without gRPC's wrapper and transport
// wording. A daemon that is not running read "connection error: desc =
// \"transport: Error while dialing: dial tcp ...: connect: connection
// refused\"", one that went away "rpc error: code = Unavailable desc =
// error reading from server: EOF".
func TestMessage(t *testing.T) {
	// A real refused connection: a port that was listened on and closed.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	conn, err := Dial(addr, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	refused := conn.Invoke(context.Background(), "/distill.v1.Teacher/Info", &emptypb.Empty{}, &emptypb.Empty{})
	if got := Message(refused); !strings.HasPrefix(got, "cannot connect: dial tcp "+addr+": ") || strings.Contains(got, "desc =") || strings.Contains(got, "transport") {
		t.Errorf("refused: %q (from %v)", got, refused)
	}
	for _, c := range []struct {
		err  error
		want string
	}{
		// grpc-go's texts (internal/transport/http2_client.go).
		{status.Error(codes.Unavailable, "error reading from server: EOF"), "the connection was lost: the daemon stopped or crashed, or the network dropped"},
		{status.Error(codes.Unavailable, `closing transport due to: connection error: desc = "error reading from server: EOF", received prior goaway: code: NO_ERROR, debug data: "graceful_stop"`),
			"the daemon is shutting down (SIGTERM or Ctrl-C) and closed the connection"},
		{status.Error(codes.Unavailable, `connection error: desc = "transport: authentication handshake failed: tls: first record does not look like a TLS handshake"`),
			"authentication handshake failed: tls: first record does not look like a TLS handshake"},
		// The daemon's own messages pass as they are.
		{status.Error(codes.InvalidArgument, "sample id 0 is empty: send at least one token id"), "sample id 0 is empty: send at least one token id"},
		{status.Error(codes.Unavailable, "teacher model still loading: retry when the health check reports SERVING"), "teacher model still loading: retry when the health check reports SERVING"},
		{errors.New("not a status"), "not a status"},
	} {
		if got := Message(c.err); got != c.want {
			t.Errorf("Message(%v) = %q, want %q", c.err, got, c.want)
		}
	}
}
