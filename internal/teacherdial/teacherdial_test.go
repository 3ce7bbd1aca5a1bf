package teacherdial

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
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
