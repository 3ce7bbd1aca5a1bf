package cli

import (
	"bytes"
	"errors"
	"flag"
	"os"
	"os/exec"
	"strings"
	"testing"
)

func testRegistry() *Registry {
	r := New("prog")
	r.Register(&Command{Name: "run", Summary: "run something", Run: func(args []string) error {
		fs := flag.NewFlagSet("prog run", flag.ContinueOnError)
		fs.SetOutput(&bytes.Buffer{})
		fs.Int("n", 0, "a number")
		if err := fs.Parse(args); err != nil {
			return err
		}
		if fs.NArg() > 0 {
			return errors.New("boom")
		}
		return nil
	}})
	return r
}

// TestHelpExitsZero: asking for help is a success (exit 0, usage on
// stdout); no command or an unknown one is a usage error (2, usage on
// stderr); a failing command is 1.
func TestHelpExitsZero(t *testing.T) {
	for _, tc := range []struct {
		args      []string
		code      int
		stdoutHas string
		stderrHas string
	}{
		{[]string{"--help"}, 0, "usage: prog COMMAND", ""},
		{[]string{"-h"}, 0, "usage: prog COMMAND", ""},
		{[]string{"-help"}, 0, "run something", ""},
		{[]string{"help"}, 0, "run something", ""},
		{[]string{"help", "run"}, 0, "", ""},
		{[]string{"run", "-h"}, 0, "", ""},
		{[]string{"run", "--help"}, 0, "", ""},
		{[]string{"run"}, 0, "", ""},
		{nil, 2, "", "usage: prog COMMAND"},
		{[]string{"nope"}, 2, "", `unknown command "nope"` + "\n"},
		{[]string{"rnu"}, 2, "", `unknown command "rnu": did you mean "run"?`},
		{[]string{"run", "extra"}, 1, "", "prog run: boom"},
		{[]string{"run", "-bad"}, 1, "", "flag provided but not defined"},
	} {
		var out, errb bytes.Buffer
		code := testRegistry().Run(tc.args, &out, &errb)
		if code != tc.code || !strings.Contains(out.String(), tc.stdoutHas) || !strings.Contains(errb.String(), tc.stderrHas) {
			t.Errorf("%q: exit %d, want %d\nstdout: %s\nstderr: %s", tc.args, code, tc.code, out.String(), errb.String())
		}
	}
}

// TestMain runs Main (which exits) when re-executed by TestMainExitCodes.
func TestMain(m *testing.M) {
	if args, ok := os.LookupEnv("CLI_TEST_MAIN_ARGS"); ok {
		testRegistry().Main(strings.Fields(args))
	}
	os.Exit(m.Run())
}

// TestMainExitCodes runs Main in a child process, as a user runs
// `student --help`: help exits 0 with the usage on stdout.
func TestMainExitCodes(t *testing.T) {
	for _, tc := range []struct {
		args string
		code int
	}{{"--help", 0}, {"-h", 0}, {"run -h", 0}, {"", 2}, {"nope", 2}, {"run extra", 1}} {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "CLI_TEST_MAIN_ARGS="+tc.args)
		var out bytes.Buffer
		cmd.Stdout = &out
		err := cmd.Run()
		code := 0
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		if code != tc.code {
			t.Errorf("prog %s: exit %d, want %d", tc.args, code, tc.code)
		}
		if tc.args == "--help" && !strings.Contains(out.String(), "usage: prog COMMAND") {
			t.Errorf("prog --help: stdout %q lacks the usage", out.String())
		}
	}
}

// TestParseFlags: an undefined flag's error names the defined flag it
// most likely meant, if one is near; -h is flag.ErrHelp as before; good
// flags parse.
func TestParseFlags(t *testing.T) {
	mk := func() (*flag.FlagSet, *string) {
		fs := flag.NewFlagSet("x", flag.ContinueOnError)
		fs.SetOutput(&bytes.Buffer{})
		c := fs.String("cache", "", "")
		fs.Int("max-len", 0, "")
		return fs, c
	}
	for _, tc := range []struct {
		args []string
		want string // in the error; "" no error
	}{
		{[]string{"--cahce", "d"}, "flag provided but not defined: -cahce (did you mean --cache?)"},
		{[]string{"-max_len=3"}, "(did you mean --max-len?)"},
		{[]string{"--zzzzzz"}, "flag provided but not defined: -zzzzzz"},
		{[]string{"--cache", "d"}, ""},
	} {
		fs, c := mk()
		err := ParseFlags(fs, tc.args)
		switch {
		case tc.want == "" && (err != nil || *c != "d"):
			t.Errorf("%v: %v, cache %q", tc.args, err, *c)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%v: %v, want %q", tc.args, err, tc.want)
		case strings.Contains(tc.args[0], "zzz") && strings.Contains(err.Error(), "did you mean"):
			t.Errorf("%v: %v suggests a flag that is not near", tc.args, err)
		}
	}
	fs, _ := mk()
	if err := ParseFlags(fs, []string{"-h"}); !errors.Is(err, flag.ErrHelp) {
		t.Errorf("-h: %v, want flag.ErrHelp", err)
	}
}
