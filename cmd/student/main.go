// Command student makes, trains and exports student models: `init` writes
// a random HF checkpoint of a given architecture and size. Each subcommand
// lives in its own file and registers itself in init.
package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"sort"
)

// command is one `student NAME` subcommand.
type command struct {
	name    string
	summary string
	run     func(args []string) error
}

var commands = map[string]*command{}

func register(c *command) {
	if _, dup := commands[c.name]; dup {
		panic("student: command registered twice: " + c.name)
	}
	commands[c.name] = c
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: student COMMAND [flags]\n\ncommands:")
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(os.Stderr, "  %-10s %s\n", n, commands[n].summary)
	}
	fmt.Fprintln(os.Stderr, "\nRun 'student COMMAND -h' for a command's flags.")
}

func main() {
	if len(os.Args) < 2 || os.Args[1] == "-h" || os.Args[1] == "--help" || os.Args[1] == "help" {
		usage()
		os.Exit(2)
	}
	c, ok := commands[os.Args[1]]
	if !ok {
		fmt.Fprintf(os.Stderr, "student: unknown command %q\n", os.Args[1])
		usage()
		os.Exit(2)
	}
	if err := c.run(os.Args[2:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(2)
		}
		fmt.Fprintf(os.Stderr, "student %s: %v\n", c.name, err)
		os.Exit(1)
	}
}
