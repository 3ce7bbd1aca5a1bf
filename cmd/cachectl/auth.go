package main

import (
	"flag"
	"os"

	"distill/internal/cli"
	"distill/internal/teacherdial"
	"distill/serve"
)

// authFlags are the flags of a teacherd client (fill, score): the bearer
// token, given as --token-file (kept out of the command line and ps),
// --token or $DISTILL_TOKEN, and the TLS CA.
type authFlags struct {
	fs                      *flag.FlagSet
	token, tokenFile, tlsCA string
}

func (a *authFlags) register(fs *flag.FlagSet) {
	a.fs = fs
	fs.StringVar(&a.tokenFile, "token-file", "", "file holding the daemons' bearer token (teacherd --token-file): kept out of the command line")
	fs.StringVar(&a.token, "token", os.Getenv("DISTILL_TOKEN"), "bearer token for the daemons (default $DISTILL_TOKEN; --token-file keeps it out of ps)")
	fs.StringVar(&a.tlsCA, "tls-ca", "", "PEM CA file: connect with TLS, trusting it")
}

// options are the dial options the flags give.
func (a *authFlags) options() (serve.DialOptions, error) {
	tokenSet := false
	a.fs.Visit(func(f *flag.Flag) { tokenSet = tokenSet || f.Name == "token" })
	o := serve.DialOptions{Token: a.token, CAFile: a.tlsCA, Names: map[teacherdial.Option]string{teacherdial.Address: "--teacher", teacherdial.CAFile: "--tls-ca"}}
	if a.tokenFile != "" {
		if tokenSet {
			return o, cli.Usagef("give only one of --token and --token-file")
		}
		t, err := teacherdial.ReadToken(a.tokenFile, "--token-file")
		if err != nil {
			return o, err
		}
		o.Token = t
	}
	return o, nil
}
